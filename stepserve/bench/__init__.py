"""Load tests that compare batching strategies (in process) or servers (HTTP), and the report users act on."""
