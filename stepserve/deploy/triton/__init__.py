"""Triton Inference Server model repositories for a stepserve pipeline (`stepserve export triton`).

Two layouts share one entry model, `pipeline`, so one client drives either:
- classic: Triton batches whole requests (its dynamic batcher) and a BLS model runs each batch to completion
  through three network models (text_encoder, unet, vae_decoder);
- stepserve: one decoupled model runs stepserve's own engine, so requests join the running batch at any step.

config.py writes config.pbtxt text, repository.py writes the folders and server.py runs the tritonserver that
ships with nvidia-pytriton. The code the Python backend runs inside Triton is a front end, in stepserve/server/triton/:
the repositories name its modules as text and import nothing of it.
"""
