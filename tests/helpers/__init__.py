"""Test helpers shared by more than one test folder, imported as `helpers.<module>` (pytest's `pythonpath`
in pyproject.toml puts tests/ on sys.path; a script a test spawns puts it there itself). Helpers one folder
alone uses stay in that folder.

- `harness`: pools of gloo processes that run a function on every rank, failing instead of hanging.
- `sharded`: the seeded single-process reference, its shards and the per-tensor error measures.
- `stages`: a rank's pipeline stages of the reference, and their gradients / parameters at full shape.
- `reference_learner`: the PPO step written directly on one model (fp32 master weights, AdamW).
- `bridge_layouts`: exports of one learner from several parallel layouts on gloo pools.
- `vllm_checks`: a tiny model vLLM's CPU kernels take, learner log-probs, deliberately wrong exports.
- `embedded_engine`: a perturbed tiny learner and an embedded engine fed its weights.
- `hf_reference`: transformers' GptOssForCausalLM with our model's weights.
- `hf_checkpoints`: HF directories as the released checkpoints are (MXFP4 experts).
- `harmony_encoding`: the installed openai_harmony and its gpt-oss encoding, vocabulary written offline.
- `router_ties`: near-tied routers for the router-replay tests.
- `triton_cpu`: skip marks for Triton kernels without a GPU or the interpreter.
- `run_logs`: a run's metrics log by step.
"""
