"""The engine: the core loop (core), its async front end and handles, admission errors, the engine's
configuration and builder, the clock, and loading a model argument into an executor."""
