"""`stepserve serve --replicas N`: the HTTP app as Ray Serve replicas, one engine per replica (docs/SCALING.md).

deployment.py and console.py are the only modules here that import Ray: options.py checks the replica flags and
maps them onto Serve's deployment options before a cluster starts, metrics.py merges the replicas' metrics into one
page, events_hub.py and fleet_events.py merge the replicas' engine steps into one live view for the console,
processes.py keeps track of a local cluster's processes, and proxy_errors.py runs in Ray's HTTP proxy and gives its
own errors the OpenAI shape.
"""
