"""ControlNets per request row: many controls in one batch.

A request names ControlNets from the server's ControlNet folder (`--controlnet-dir`, one diffusers ControlNet folder
per name), each with its own image, scale and window of the schedule. In a step, every ControlNet in use runs once
on the rows that use it (at this step: diffusers' `controlnet_keep`), each row's residuals are weighted by its
scale and summed per row as diffusers' MultiControlNetModel sums them, and the denoiser's one forward for the whole
batch takes them (zero for rows without a control). A batch without controls runs nothing of this.

The package's parts: `spec` (what a request asks for; no torch), `errors`, `store` (the folder, loading on first
use within a memory budget, least recently used idle ones unloaded) and `rows` (preparing a request's images and
the step's per-row residuals).
"""
