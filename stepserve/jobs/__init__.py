"""Jobs over the state store: video jobs and async image requests, run by whichever process of the service has
room (runner.py), followed through the store by every process (changes.py), swept after --keep-results-h
(sweep.py). Above the engine, below the server: no HTTP here (the server gives the kinds of job: kinds.py)."""
