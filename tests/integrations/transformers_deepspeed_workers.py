"""One process of tests/integrations/test_transformers_deepspeed.py: the Hugging Face Trainer
under DeepSpeed ZeRO (each stage of ``STAGES``) on the CPU (gloo), trained twice from the same weights on the same data:
with ``gradfuse.integrations.transformers.attach`` (gradfuse clips at ``max_grad_norm``) and
without (DeepSpeed's own ``gradient_clipping``, which the Trainer sets from ``max_grad_norm``).
What each run logged goes to ``out_dir/rank{rank}.json``."""
import importlib
import json
import os
import warnings

import torch

MAX_GRAD_NORM = 0.5  # small enough that every update clips
STEPS = 3
STAGES = (1, 2, 3)
LR = 0.05


def deepspeed_config(stage):
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9}


def run(out_dir, rank, with_gradfuse, stage):
    """One Trainer run; returns what it logged (and, with gradfuse, the monitor's counters and
    DeepSpeed's clip setting after train())."""
    from transformers import Trainer, TrainingArguments
    from transformers_harness import Tokens, tiny_gpt2

    import gradfuse
    from gradfuse.integrations.transformers import attach

    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = TrainingArguments(
        output_dir=f"{out_dir}/trainer{stage}{int(with_gradfuse)}", max_steps=STEPS, per_device_train_batch_size=2,
        learning_rate=LR, lr_scheduler_type="constant",
        gradient_accumulation_steps=2, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
        max_grad_norm=MAX_GRAD_NORM, dataloader_num_workers=0, seed=0, save_strategy="no",
        deepspeed=deepspeed_config(stage))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(optimizer, scheduler))
    sinks = [gradfuse.JsonlSink(f"{out_dir}/stage{stage}_run{rank}.jsonl")]
    callback = attach(trainer, sinks=sinks) if with_gradfuse else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    out = {"log": [h for h in trainer.state.log_history if "loss" in h]}
    if callback is not None:
        out["counters"] = callback.monitor.counters()
        out["engine_clip_after"] = trainer.model_wrapped.gradient_clipping()
        out["optimizer_clip_after"] = trainer.model_wrapped.optimizer.clip_grad
        callback.close()
    return out


def worker(rank, world, port, out_dir, stages):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu",
                      HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    # The CPU accelerator builds its shared-memory op (about 100 s) on init_distributed; gloo does without it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import logging

    from deepspeed.utils import logger
    logger.setLevel(logging.WARNING)
    result = {stage: {"gradfuse": run(out_dir, rank, True, stage), "deepspeed": run(out_dir, rank, False, stage)}
              for stage in stages}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
