"""LoRA adapters per request row: many adapters in one batch.

Adapters are read and injected by diffusers' own LoRA loaders (every format they read: diffusers/PEFT, kohya,
...) through PEFT, then PEFT's own application is switched off: each adapted layer's base weight runs once for
the whole batch, and a forward hook adds to each row the low-rank updates of that row's own adapters, weighted by
the request's scales (as diffusers' `set_adapters` weights them), the rows that share an adapter in one matmul
(Punica / S-LoRA style grouping). No weights are fused or unfused per step.

The package's parts: `spec` (what a request asks for), `errors`, `gate` (admission waits for an adapter to load),
`folder` (the adapter folder: names, paths), `inject` (reading a file and injecting it through PEFT), `store`
(loading, the memory budget, eviction), `rows` (the per-row forward hook) and `serving` (what an engine asks: the
folder at start-up, the rows' keys per step). This module imports no torch.
"""
