"""The front ends over the async engine.

- The HTTP front end, an OpenAI-compatible images API (docs/HTTP_API.md): app.py builds the app (routes, auth,
  health, metrics), schemas.py parses a request body, images.py does the images endpoint's per-request work
  (admission, waiting, outcomes, PNG), streaming.py sends its server-sent events, errors.py the OpenAI error shape,
  metrics.py the Prometheus series.
- ray/: the same app as Ray Serve replicas (`stepserve serve --replicas N`).
- triton/: the models that run inside tritonserver (repositories written by `stepserve export triton`).

This package imports none of its modules, so the Triton models load without the HTTP stack.
"""
