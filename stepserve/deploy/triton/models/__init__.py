"""Code the Python backend runs inside Triton. Each model folder's model.py is a one-line import of one of these
modules, so a repository always runs the stepserve that is installed next to the Triton stub.

Only network.py, classic_pipeline.py and stepserve_pipeline.py import triton_python_backend_utils (it exists only
inside Triton); requests.py is plain numpy and stepserve, so it is tested without a server.
"""
