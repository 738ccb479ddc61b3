"""The command layer: one module per `stepserve <command>` (cli.py dispatches), each parsing its flags and calling
the library below it. Flags that several commands share are defined once, in flags.py."""
