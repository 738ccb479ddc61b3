"""What LoRA adapters, ControlNets and IP-Adapters share: one budgeted store of named add-ons (store.py), their
sizes read from the weight files before a load (sizes.py), and their errors (errors.py)."""
