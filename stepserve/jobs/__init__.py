"""Jobs that outlive a request (video jobs, async image jobs): their runs, their results and their webhooks. Over
the state store: run by whichever process of the service has room (runner.py), followed through the store by every
process (changes.py), swept after --keep-results-h (sweep.py), notified once by webhook (notify.py, webhooks.py:
an outbox in the store; targets.py: where webhooks may go).
Above the engine, below the server: no HTTP here (the server gives the kinds of job: kinds.py)."""
