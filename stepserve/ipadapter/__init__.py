"""IP-Adapters per request row: an image as a prompt, in the same batches as everything else.

A request names an IP-Adapter from the server's folder (`--ip-adapter-dir`, one sub-folder per name holding the
adapter's weights and its CLIP image encoder) with an image and a scale. The image's embedding is computed once per
request (the requests admitted together in one encoder pass); in a step that has such rows the adapter's attention
processors and image projection are put in the UNet for that forward only, each row with its own embedding and
scale (rows without an image prompt: a zero embedding and scale 0, so they get the plain model's output exactly).
A step without image prompts runs the plain UNet.

The package's parts: `spec` (what a request asks for; no torch), `parts` (the folder layout, the weights, the
errors), `store` (the adapters loaded within their memory), `rows` (the per-row scale and the step's UNet
keywords) and `serving` (start-up).
"""
