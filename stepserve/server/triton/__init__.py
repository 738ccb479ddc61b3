"""The front end that runs inside tritonserver: the code of the models its Python backend loads. The repositories
that load it are written by `stepserve export triton` (stepserve/deploy/triton/): each model folder's model.py is a
one-line import of one of these modules, so a repository always runs the stepserve that is installed next to the
Triton stub.

- stepserve_pipeline.py: the stepserve layout's entry model, stepserve's own engine in one decoupled model;
- classic_pipeline.py: the classic layout's entry model, whole batches from Triton's dynamic batcher, calling
  the three network models over BLS (bls_networks.py);
- network.py: a classic-layout network model (text_encoder, unet or vae_decoder) run by onnxruntime.

Only network.py, classic_pipeline.py, stepserve_pipeline.py and bls_networks.py import triton_python_backend_utils
(it exists only inside Triton); requests.py (the entry model's tensors <-> SamplingParams and images) and
settings.py are plain numpy and stepserve, so they are tested without a server.
"""
