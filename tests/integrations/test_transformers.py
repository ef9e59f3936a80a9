"""gradfuse.integrations.transformers.attach against the real transformers.Trainer (CPU, a
2-layer GPT-2 built from a config, synthetic tokens, no downloads)."""
import json
import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import TrainerCallback  # noqa: E402
from transformers_harness import PlantNaN, make_trainer, tiny_gpt2, train  # noqa: E402

from gradfuse.integrations.transformers import GradfuseCallback, attach  # noqa: E402

MAX_NORM = 0.05


def test_clip_matches_trainers_own_with_accumulation_and_logs_reach_tensorboard(tmp_path, monkeypatch):
    ref, ref_opt = make_trainer(tmp_path / "ref", MAX_NORM)
    train(ref)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    trainer, opt = make_trainer(tmp_path / "ours", MAX_NORM, report_to=["tensorboard"])
    cb = attach(trainer)  # takes over max_grad_norm
    train(trainer)
    assert trainer.args.max_grad_norm == MAX_NORM  # handed back after train()
    assert len(opt.stepped_grads) == len(ref_opt.stepped_grads) == 4  # once per optimizer step
    for ours, theirs in zip(opt.stepped_grads, ref_opt.stepped_grads):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # The Trainer's own grad_norm log (pre-clip) came from gradfuse's pass and matches its own.
    ref_logs = [h for h in ref.state.log_history if "loss" in h]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["grad_norm"] > MAX_NORM for h in ref_logs)  # there was clipping to compare
    for h, r in zip(logs, ref_logs):
        assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
        assert h["grad/total_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    assert [h["step"] for h in logs] == [1, 2, 3, 4]
    assert logs[-1]["grad/clipped_steps"] == 4 and logs[-1]["grad/clip_coef"] < 1
    # Layers by block index, not one row for all of transformer.h.
    assert {"grad_l2/transformer.h.0", "grad_l2/transformer.h.1", "grad_l2/transformer.wte",
            "grad_l2/transformer.ln_f"} <= set(logs[-1])
    assert cb.monitor.step_count == 5 and cb.last_report.step == 4  # the Trainer's numbering
    # ... and through the Trainer's own TensorBoard reporting.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/grad/total_norm")] == [1, 2, 3, 4]
    assert "train/grad_l2/transformer.h.1" in acc.Tags()["scalars"]


def test_planted_nan_step_skipped_and_state_resumes(tmp_path):
    trainer, opt = make_trainer(tmp_path, 1.0, accumulate=1, max_steps=4,
                                save_strategy="steps", save_steps=2)
    planter = PlantNaN(at_step=1, opt=opt)
    trainer.add_callback(planter)
    events = []
    sink = type("Events", (), {"write": lambda self, record: events.append(record)})()
    cb = attach(trainer, explode_threshold=1e6, sinks=[sink])
    train(trainer)
    # gradfuse saw the gradients before the Trainer's own norm pass (which multiplies every
    # gradient by a NaN norm): the one parameter at fault is named.
    event = [r for r in events if r["event"]][0]
    assert event["step"] == 2 and event["skipped"]
    assert "1 parameter(s): transformer.h.1.mlp.c_fc.weight (nan=1" in event["message"]
    assert planter.unchanged is True  # no parameter, moment or step-count update
    assert len(opt.stepped_grads) == 3  # the update numbered 2 was not taken
    m = cb.monitor
    assert (m.skipped_steps, m.nonfinite_steps, m.anomaly_steps) == (1, 1, 1)
    second = [h for h in trainer.state.log_history if h.get("step") == 2 and "loss" in h][0]
    assert second["grad/skipped"] == 1.0 and second["grad/nonfinite"] == 1.0
    assert second["grad_nonfinite/transformer.h.1"] >= 1
    # Resume from the checkpoint at step 2: numbering and counts continue.
    trainer2, _ = make_trainer(tmp_path, 1.0, accumulate=1, max_steps=4,
                               save_strategy="steps", save_steps=2)
    cb2 = attach(trainer2)
    train(trainer2, resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    state = cb2.monitor.state_dict()
    assert (state["step"], state["skipped_steps"], state["nonfinite_steps"]) == (5, 1, 1)
    # The history restored from the checkpoint kept the statistics of steps 1-2.
    assert [h["step"] for h in trainer2.state.log_history if "grad/total_norm" in h] == [1, 2, 3, 4]
    assert [h["grad/skipped_steps"] for h in trainer2.state.log_history if "loss" in h] == [0, 1, 1, 1]


def test_without_the_norm_call_the_monitor_runs_before_the_optimizer_step(tmp_path, monkeypatch):
    """Where gradfuse does not answer the Trainer's norm call (DeepSpeed, XLA, FSDP1), the
    monitor runs in on_pre_optimizer_step: the same clipping."""
    ref, ref_opt = make_trainer(tmp_path / "ref", MAX_NORM, accumulate=1, max_steps=2)
    train(ref)
    monkeypatch.setattr(GradfuseCallback, "_take_over_norm_call", lambda self: None)
    trainer, opt = make_trainer(tmp_path / "ours", MAX_NORM, accumulate=1, max_steps=2)
    cb = attach(trainer)
    train(trainer)
    assert cb.monitor.clipped_steps == 2 and len(opt.stepped_grads) == 2
    for ours, theirs in zip(opt.stepped_grads, ref_opt.stepped_grads):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


class PlantAt(TrainerCallback):
    """Multiplies a gradient during the backward of given updates (inf: an fp16 overflow; a big
    number: an explosion)."""

    def __init__(self, factors):
        self.factors, self.factor = factors, None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def plant(param):
            if self.factor is not None:
                param.grad.mul_(self.factor)
        model.transformer.h[0].attn.c_attn.weight.register_post_accumulate_grad_hook(plant)

    def on_step_begin(self, args, state, control, **kwargs):
        self.factor = self.factors.get(state.global_step)


def test_grad_scaler_overflow_and_skip_keep_the_scaler_consistent(tmp_path):
    """With accelerate's GradScaler (fp16 needs a GPU, so a CPU scaler is put in by hand): an
    overflow is the scaler's (not an anomaly), and a step gradfuse skips still gets the scaler's
    bookkeeping, so the next steps unscale and step normally."""
    trainer, opt = make_trainer(tmp_path, 1.0, accumulate=1, max_steps=5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer.accelerator.scaler = scaler  # before train(): prepare() hands it to the optimizer
    trainer.add_callback(PlantAt({1: math.inf, 3: 1e9}))
    cb = attach(trainer, explode_threshold=1e6)
    train(trainer)
    m = cb.monitor
    assert (m.amp_overflow_steps, m.anomaly_steps, m.explode_steps, m.skipped_steps) == (1, 1, 1, 1)
    assert len(opt.stepped_grads) == 3  # the overflow (scaler) and the explosion (gradfuse) skipped
    assert scaler.get_scale() == 2.0**7
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_layers_of_gpt2_bert_t5_are_their_blocks():
    """The default grouping gives one row per transformer block, not one for all of them."""
    from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

    import gradfuse
    small = dict(vocab_size=64)
    models = {
        "gpt2": tiny_gpt2(),
        "bert": BertForMaskedLM(BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=32, max_position_embeddings=16, **small)),
        "t5": T5ForConditionalGeneration(T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                                  num_decoder_layers=2, num_heads=2, decoder_start_token_id=0,
                                                  **small)),
    }
    ids = torch.randint(0, 64, (2, 8))
    for model in models.values():
        kw = {"decoder_input_ids": ids} if model.config.model_type == "t5" else {}
        model(input_ids=ids, labels=ids, **kw).loss.backward()
    layers = {k: set(gradfuse.stats(m).layers()) for k, m in models.items()}
    assert {"transformer.h.0", "transformer.h.1", "transformer.wte", "transformer.ln_f"} <= layers["gpt2"]
    assert {"bert.encoder.layer.0", "bert.encoder.layer.1", "bert.embeddings.word_embeddings"} <= layers["bert"]
    assert {"encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1", "shared"} <= layers["t5"]
    assert not any(name in layers["gpt2"] for name in ("transformer.h", "transformer"))


def test_callbacks_list_needs_attach():
    with pytest.raises(TypeError):
        GradfuseCallback()  # it needs the Trainer: use attach(trainer)


def _run_recording_warnings(trainer):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = trainer.train()
    return out, sorted({(w.category.__name__, str(w.message)) for w in seen})


def _args_dict(args, root):
    # The training arguments as plain values, without the paths of the run's own folder.
    return {k: v for k, v in args.to_dict().items() if str(root) not in str(v)}


def _tensorboard_args(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    text = acc.Tensors("args/text_summary")[0].tensor_proto.string_val[0].decode()
    return json.loads(text)


GRADFUSE_KEYS = ("grad/", "grad_l2/", "grad_zero_fraction/", "grad_nonfinite/", "grad_max_abs/")


@pytest.mark.parametrize("own_optimizer", [True, False], ids=["given_optimizer", "trainers_optimizer"])
def test_what_the_trainer_saves_logs_and_returns_is_its_own(tmp_path, monkeypatch, own_optimizer):
    """Against the same run without gradfuse: the checkpoints hold the same training arguments
    (max_grad_norm as given), scheduler state, Trainer state and log history (grad_norm
    included) but for gradfuse's added statistics and state, the same optimizer state and weights
    up to the clip's rounding; TensorBoard gets the same arguments; train() returns the same; no
    warning is raised that the run without gradfuse does not raise (an LR scheduler that the
    Trainer builds on its AcceleratedOptimizer before the callback gates it included)."""
    runs = {}
    for name in ("ref", "ours"):
        monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / name / "tb"))
        trainer, _ = make_trainer(tmp_path / name, MAX_NORM, accumulate=2, max_steps=4, save_strategy="steps",
                                  save_steps=2, report_to=["tensorboard"], own_optimizer=own_optimizer,
                                  lr_scheduler_type="linear", warmup_steps=1)
        cb = attach(trainer) if name == "ours" else None
        out, seen = _run_recording_warnings(trainer)
        runs[name] = trainer, out, seen, cb
    (ref, ref_out, ref_warnings, _), (ours, out, our_warnings, cb) = runs["ref"], runs["ours"]
    assert our_warnings == ref_warnings
    assert cb.monitor.clipped_steps == 4  # the clip was gradfuse's, at every update
    # What train() returns, and the arguments the Trainer keeps
    assert out.global_step == ref_out.global_step == 4
    assert out.training_loss == pytest.approx(ref_out.training_loss, rel=1e-5)
    assert out.metrics.keys() == ref_out.metrics.keys()
    assert _args_dict(ours.args, tmp_path / "ours") == _args_dict(ref.args, tmp_path / "ref")
    assert ours.args.max_grad_norm == MAX_NORM
    # What TensorBoard was told (the arguments are logged at the start of train())
    assert (_args_dict_of(_tensorboard_args(tmp_path / "ours" / "tb"), tmp_path / "ours")
            == _args_dict_of(_tensorboard_args(tmp_path / "ref" / "tb"), tmp_path / "ref"))
    # What the checkpoints hold
    for step in (2, 4):
        mine, theirs = tmp_path / "ours" / f"checkpoint-{step}", tmp_path / "ref" / f"checkpoint-{step}"
        assert sorted(p.name for p in mine.iterdir()) == sorted(p.name for p in theirs.iterdir())
        saved = [torch.load(d / "training_args.bin", weights_only=False) for d in (mine, theirs)]
        assert saved[0].max_grad_norm == MAX_NORM
        assert _args_dict(saved[0], tmp_path / "ours") == _args_dict(saved[1], tmp_path / "ref")
        assert torch.load(mine / "scheduler.pt") == torch.load(theirs / "scheduler.pt")
        _assert_close_nested(torch.load(mine / "optimizer.pt"), torch.load(theirs / "optimizer.pt"))
        from safetensors.torch import load_file
        _assert_close_nested(load_file(mine / "model.safetensors"), load_file(theirs / "model.safetensors"))
        state, ref_state = (json.loads((d / "trainer_state.json").read_text()) for d in (mine, theirs))
        assert state.pop("stateful_callbacks").pop("gradfuse")["step"] == step + 1
        ref_state.pop("stateful_callbacks")
        history, ref_history = state.pop("log_history"), ref_state.pop("log_history")
        assert state == ref_state and len(history) == len(ref_history) == step
        for h, r in zip(history, ref_history):
            added = {k for k in h if k.startswith(GRADFUSE_KEYS)}
            assert added and h.keys() - added == r.keys()
            for key in r:
                assert h[key] == pytest.approx(r[key], rel=1e-5), key
    assert [h["learning_rate"] for h in ours.state.log_history if "loss" in h] == [
        h["learning_rate"] for h in ref.state.log_history if "loss" in h]


def _args_dict_of(values: dict, root):
    return {k: v for k, v in values.items() if str(root) not in str(v)}


def _assert_close_nested(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_close_nested(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_close_nested(x, y)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    else:
        assert a == b


@pytest.mark.parametrize("own_optimizer", [True, False], ids=["given_optimizer", "trainers_optimizer"])
def test_a_skipped_first_update_raises_no_scheduler_warning(tmp_path, own_optimizer):
    """A first update that gradfuse skips (non-finite gradients): the Trainer's LR scheduler, built
    before the step gate, warns neither that the step was overridden nor that it stepped before
    the optimizer; gradfuse's own warning about the skip is the only one."""
    trainer, _ = make_trainer(tmp_path, MAX_NORM, accumulate=1, max_steps=3, own_optimizer=own_optimizer)
    trainer.add_callback(PlantAt({0: math.nan}))
    cb = attach(trainer)
    _, seen = _run_recording_warnings(trainer)
    assert cb.monitor.skipped_steps == 1
    assert [m for _, m in seen] == [m for _, m in seen if "optimizer step skipped" in m] and len(seen) == 1


def test_the_trainers_fused_adamw_never_waits(tmp_path):
    """The Trainer's own optimizer (fused AdamW, its default) takes the skip on the device: by
    default gradfuse reads nothing of an update on the host (against blocking=True), the update
    with a planted NaN is skipped on the device, and the weights, the optimizer state, the log
    history (grad_norm included), the learning rates and the records are the blocking run's."""
    from sync_guard import SyncGuard

    import gradfuse
    runs = {}
    for mode in ("blocking", "default"):
        trainer, _ = make_trainer(tmp_path / mode, MAX_NORM, accumulate=1, max_steps=4, own_optimizer=False,
                                  lr_scheduler_type="linear", warmup_steps=1)
        trainer.add_callback(PlantAt({1: math.nan}))
        records = []
        sink = type("Records", (), {"write": lambda self, record, records=records: records.append(record)})()
        cb = attach(trainer, sinks=[sink], **({"blocking": True} if mode == "blocking" else {}))
        guard = SyncGuard(allowed=None, host_copies=True)
        with guard:
            train(trainer)
        runs[mode] = trainer, cb, guard, records
    (tb, cbb, gb, rb), (td, cbd, gd, rd) = runs["blocking"], runs["default"]
    assert type(td.optimizer.optimizer) is torch.optim.AdamW and td.optimizer.optimizer.defaults["fused"]
    assert cbd.monitor._defers and not cbb.monitor._defers
    assert gd.reads_from(gradfuse) == [] and len(gb.reads_from(gradfuse)) >= 4
    assert cbd.monitor.counters() == cbb.monitor.counters() and cbd.monitor.skipped_steps == 1
    assert [(r["step"], r["event"], r["skipped"]) for r in rd] == [(r["step"], r["event"], r["skipped"]) for r in rb]
    assert (2, True, True) in [(r["step"], r["event"], r["skipped"]) for r in rd]
    assert all(torch.equal(a, b) for a, b in zip(tb.model.parameters(), td.model.parameters(), strict=True))
    sb, sd = tb.optimizer.optimizer.state_dict()["state"], td.optimizer.optimizer.state_dict()["state"]
    assert sd and all(torch.equal(sb[k][n], sd[k][n]) for k in sb for n in sb[k])
    assert float(sd[0]["step"]) == 3  # 4 updates, one skipped
    hb, hd = ([h for h in t.state.log_history if "loss" in h] for t in (tb, td))
    assert len(hd) == 4 and [h.keys() for h in hd] == [h.keys() for h in hb]
    for h, r in zip(hd, hb):
        assert all(h[k] == r[k] or (math.isnan(h[k]) and math.isnan(r[k])) for k in h), h["step"]
    assert math.isnan(hd[1]["grad_norm"]) and hd[1]["grad/skipped"] == 1.0
