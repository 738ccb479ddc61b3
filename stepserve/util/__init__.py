"""Small utilities shared by the commands and front ends: words, digits, ports, progress, signals, API keys."""
