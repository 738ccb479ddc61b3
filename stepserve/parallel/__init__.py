"""One request over several devices: sequence (Ulysses, ring), CFG and tensor parallelism behind the executor.

A parallel model is still one engine. Rank 0 runs the front end, the engine core and its policy as with one device;
its executor (executor.ParallelExecutor) sends each stage's plain inputs to the other ranks (worker.py), every rank
runs the same stage on a mirror of the same requests, and the networks' forward is split between them:

- sequence parallel (`--ulysses-degree`, `--ring-degree`): diffusers' own context-parallel hooks on the
  transformer (`ModelMixin.enable_parallelism(ContextParallelConfig)`, the model's `_cp_plan`) split the tokens;
  the forward's output is gathered on every rank, so every rank keeps the same latents;
- CFG parallel (`--cfg-parallel`): our own (diffusers has no hook for it): the conditional rows run on one half of
  the ranks and the unconditional rows on the other, gathered before the guidance step (split.py);
- tensor parallel (`--tensor-parallel-size`): diffusers' hooks (`TensorParallelConfig`, the model's `_tp_plan`).

degrees.py names and checks the degrees (one line at start-up for what cannot run), ranks.py starts and watches
the worker processes, split.py applies the split to a loaded pipeline on every rank.
"""
