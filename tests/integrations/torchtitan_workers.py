"""One rank of a torchtitan run with gradfuse attached (``python torchtitan_workers.py LAYOUT
OUT``, with torchrun's environment; test_torchtitan.py starts two). LAYOUT: ``fsdp``, ``tp`` or
``pp``. At each step, before the monitor: torchtitan's own total norm of the same gradients and
each local parameter's full-gradient norm (``full_tensor()`` in float64, the reference); then the monitor's
step with the c10d collectives it dispatches counted; after it, the gradients against
torchtitan's clip of the same ones. Step 2 has a NaN planted on rank 0 (but in ``resumed``, which
continues ``saved`` from its checkpoint). Writes OUT/LAYOUT.rank{r}.json and rank 0's records
to OUT/LAYOUT.jsonl."""
import json
import math
import os
import sys

import torch
import torchtitan_cpu
from torch.utils._python_dispatch import TorchDispatchMode

torchtitan_cpu.apply()

import torchtitan.distributed.utils as dist_utils  # noqa: E402

import gradfuse  # noqa: E402
from gradfuse.core.mesh_pieces import clean_name  # noqa: E402
from gradfuse.integrations import torchtitan as gtt  # noqa: E402

CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no-last-save-model-only"]
LAYOUTS = {"fsdp": ["--parallelism.data-parallel-shard-degree", "2"],
           "saved": ["--parallelism.data-parallel-shard-degree", "2", *CHECKPOINT],  # 4 steps, saved
           "resumed": ["--parallelism.data-parallel-shard-degree", "2", *CHECKPOINT, "--training.steps", "6"],
           "tp": ["--parallelism.tensor-parallel-degree", "2"],
           "pp": ["--parallelism.pipeline-parallel-degree", "2", "--metrics.enable-tensorboard"],
           "device": ["--parallelism.data-parallel-shard-degree", "2"]}  # the skip decided on the device
NAN_AT = 2  # the step (0-based) whose gradient gets a NaN on rank 0
MAX_NORM = 0.5  # below the debug model's gradient norms (about 0.7-1): every step clips


class CountCollectives(TorchDispatchMode):
    """Counts the c10d collectives dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.count += 1
        return func(*args, **(kwargs or {}))


def main(layout: str, out: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    config = torchtitan_cpu.config(out, [*LAYOUTS[layout], "--training.max-norm", str(MAX_NORM)])
    trainer = config.build()
    try:
        gtt.attach(trainer, clip_value=0.1)
        refused = None
    except ValueError as e:
        refused = str(e)
    attach = gradfuse.attach if layout == "tp" else gtt.attach  # the same attachment, either way
    handle = attach(trainer, every=1, on_nonfinite="skip", histogram=True,
                    recorder=gradfuse.FlightRecorder(dump_dir=f"{out}/{layout}.dumps"),
                    sinks=[gradfuse.JsonlSink(f"{out}/{layout}.jsonl")],
                    **({} if layout == "device" else {"blocking": True}))
    assert isinstance(handle, gtt.TorchtitanAttachment)
    monitored = handle._clip  # the attachment's clip, as train_step finds it
    stepped, moved, first = [], [], next(p for part in trainer.model_parts for p in part.parameters())
    trainer.optimizers.register_step_pre_hook(lambda *_: moved.append(first.to_local().clone()))
    trainer.optimizers.register_step_post_hook(lambda *_: stepped.append(len(steps)))
    trainer.optimizers.register_step_post_hook(
        lambda *_: moved.append(not torch.equal(moved.pop(), first.to_local())))
    names = {id(p): clean_name(n) for part in trainer.model_parts for n, p in part.named_parameters()}
    steps = []

    def checked(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, pp_mesh=None,
                ep_enabled=False):
        parameters = list(parameters)
        step = len(steps)
        # torchtitan's total norm of these gradients (max_norm inf: scaled by 1, nothing changed)
        theirs = float(handle._torchtitan_clip(parameters, math.inf, norm_type, False, True, pp_mesh, ep_enabled))
        if step == NAN_AT and rank == 0 and layout != "resumed":
            parameters[0].grad.to_local().view(-1)[0] = math.nan
        full = {names[id(p)]: float(p.grad.full_tensor().double().norm()) for p in parameters}
        before = [p.grad.to_local().clone() for p in parameters]
        with CountCollectives() as counted, gradfuse.HostReads() as reads:
            ours = monitored(parameters, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled)
        report = handle.last_report
        rows = dict(zip(report.stats.names, report.stats.norm(2.0).tolist()))
        coef = min(1.0, max_norm / (theirs + 1e-6))
        # torchtitan's norm is a float32 reduction, gradfuse's a float64 sum of float32 rows: their
        # coefficients differ by its rounding (up to 2e-4 on the debug model's lm_head)
        scaled = all(torch.allclose(p.grad.to_local(), b * coef, rtol=3e-4, atol=0)
                     for p, b in zip(parameters, before)) if step != NAN_AT else None
        steps.append({"theirs": theirs, "ours": float(ours), "full": full,
                      "rows": rows, "collectives": counted.count, "host_reads": len(reads.reads_from(gradfuse)),
                      "skip": report.skip if report.settled else None, "scaled_like_theirs": scaled,
                      "coef": coef})
        return ours

    dist_utils.clip_grad_norm_ = checked
    trainer.train()
    handle.detach()
    numel = {clean_name(n): p.numel() for part in trainer.model_parts for n, p in part.named_parameters()}
    header, arrays = handle.monitor.recorder.unroll()
    recorded = arrays["scalars"][:, header["scalar_fields"].index("grad_norm")].tolist()
    result = {"numel": numel, "steps": steps, "moved": moved, "blocking": handle.blocking, "stepped": stepped,
              "local": handle.monitor.source.local_names,
              "names": handle.monitor.source.names, "counters": handle.monitor.counters(), "refused": refused,
              "recorded_norms": recorded}
    with open(f"{out}/{layout}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
