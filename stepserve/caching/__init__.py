"""Step caching per request row: inside one batched forward, each request decides for itself whether to run the
whole denoiser or reuse work cached from its own earlier steps, and the rows that reuse leave the expensive part
of the forward (the batch gathers only the rows that must run it).

Policies (the request's CacheSpec, stepserve/caching/spec.py):
- fbcache, First-Block Cache (ParaAttention's FBCache; diffusers 0.42 `FirstBlockCacheConfig` is the reference
  definition on Flux): run the first block; when its residual changed by at most `threshold` (relative L1, a
  ratio of means) since the last full step, skip the rest and add the rest's residual cached at that step. On a
  UNet the "first block" is the shallow branch (conv_in and the first down block) and the reused part is the deep
  features entering the last up block, as DeepCache reuses them.
- deepcache, DeepCache (Ma, Fang, Wang, CVPR 2024), UNets: a full forward every `interval` steps; in between
  only the shallow branch runs, on the deep features cached at the last full step.
- magcache, MagCache (Ma et al. 2025; diffusers 0.42 `MagCacheConfig` with its FLUX_MAG_RATIOS): skip whole
  forwards while the accumulated error predicted from the magnitude ratios stays within `threshold`.

State lives on the request (Request.step_cache, a RowState): one branch per row kind (the conditional row, and
the unconditional row of classifier-free guidance), so a request's decisions never depend on its batch-mates.
"""
