"""HF Trainer with ``gradient_checkpointing=True`` trains through ckpt_graph regions.

Tiny GPT-2 and Llama (random init, tests/integration/hf_models.py): a few Trainer steps with
ckpt_graph give the loss and parameters of the same Trainer run without checkpointing, bit for
bit, with a lower peak. See Note [Surviving gradient_checkpointing_enable].
"""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_graph as cg
from ckpt_graph._errors import CkptGraphError
from ckpt_graph.memory import measure

transformers = pytest.importorskip("transformers", reason="needs transformers")

from ckpt_graph.integrations import transformers as cg_hf  # noqa: E402

from .hf_models import SEQ, VOCAB, build  # noqa: E402

STEPS = 3


def _dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (16, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _args(output_dir: Path, **extra: Any) -> Any:
    """TrainingArguments of the runs compared here: ``STEPS`` steps on the CPU, a loss
    logged at every step, nothing saved or reported."""
    return transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        **extra,
    )


def _train(
    model: Any, tmp_path: Path, gc: bool, flag: str = "activation_checkpointing", **extra: Any
) -> tuple[list[float], Any]:
    """Trainer steps on ``model``; the per-step losses and the trainer.

    ``flag`` is the TrainingArguments name of the switch: ``activation_checkpointing``
    (transformers 5) or its deprecated alias ``gradient_checkpointing``.
    """
    extra[flag] = gc
    trainer = transformers.Trainer(
        model=model, args=_args(tmp_path, **extra), train_dataset=_dataset()
    )
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == STEPS
    return losses, trainer


def _params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("kind", "flag"),
    [
        ("gpt2", "activation_checkpointing"),
        ("llama", "activation_checkpointing"),
        ("gpt2", "gradient_checkpointing"),
    ],
)
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_trainer_gradient_checkpointing_runs_ckpt_graph_exactly(
    kind: str, flag: str, tmp_path: Path
) -> None:
    plain = build(kind)
    model = copy.deepcopy(plain)
    ref_losses, _ = _train(plain, tmp_path / "plain", gc=False, flag=flag)
    used: list[int] = []

    def policy(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        used.append(ctx.op_index)

    cg_hf.enable(model, policy=policy)
    losses, _ = _train(model, tmp_path / "cg", gc=True, flag=flag)
    assert cg_hf.is_enabled(model) and used  # the Trainer's enable call installed ckpt_graph
    assert losses == ref_losses
    for name, ref in _params(plain).items():
        torch.testing.assert_close(_params(model)[name], ref, rtol=0, atol=0, msg=name)


def _peak(model: Any, tmp_path: Path, gc: bool) -> int:
    return measure(_train, model, tmp_path, gc).peak_bytes


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_trainer_peak_lower_with_ckpt_graph(kind: str, tmp_path: Path) -> None:
    plain_peak = _peak(build(kind), tmp_path / "plain", gc=False)
    peak = _peak(cg_hf.enable(build(kind)), tmp_path / "cg", gc=True)
    assert peak < 0.8 * plain_peak, (peak, plain_peak)


def test_trainer_kwargs_policy_and_torch_keywords(tmp_path: Path) -> None:
    model = cg_hf.enable(build("gpt2", layers=2))
    regions: list[object] = []  # the regions themselves: ids of dead ones are reused

    def policy(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        if not any(r is ctx.region for r in regions):
            regions.append(ctx.region)

    kwargs = {"policy": policy, "use_reentrant": False, "every_n_layers": 2}
    _train(model, tmp_path, gc=True, activation_checkpointing_kwargs=kwargs)
    assert cg_hf.is_enabled(model)
    funcs = [
        m._gradient_checkpointing_func for m in model.transformer.h if m.gradient_checkpointing
    ]
    assert len(funcs) == 1  # every_n_layers=2 of 2 layers
    assert funcs[0].policy is policy and funcs[0].options == {"use_reentrant": False}
    assert len(regions) == STEPS  # one checkpointed layer per step


def test_enable_path_errors_name_the_fix() -> None:
    model = cg_hf.enable(build("gpt2", layers=2))
    with pytest.raises(CkptGraphError, match=r"does not take offload=True.*policies.offload"):
        model.activation_checkpointing_enable(offload=True)
    with pytest.raises(CkptGraphError, match=r"\['nope'\] of GPT2LMHeadModel are not checkpoint"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"nope": 1})


def test_replaced_function_warns_and_disable_restores_transformers_path() -> None:
    model = cg_hf.enable(build("gpt2", layers=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cg_hf.check(model)
    # A path enable() cannot intercept: transformers' private setter, torch's checkpoint.
    model._set_gradient_checkpointing(enable=True)
    assert not cg_hf.is_enabled(model) and model.is_activation_checkpointing
    with pytest.warns(UserWarning, match=r"now checkpoint with checkpoint, which replaced"):
        assert not cg_hf.check(model)
    model.activation_checkpointing_enable()  # the public path goes back to ckpt_graph
    assert cg_hf.is_enabled(model)
    cg_hf.disable(model)
    assert not model.is_activation_checkpointing
    model.activation_checkpointing_enable()  # transformers' own checkpointing again
    assert model.is_activation_checkpointing and not cg_hf.is_enabled(model)
    assert cg_hf.check(model)  # never enabled since disable(): nothing to warn about


def test_enable_survives_deepcopy() -> None:
    model = copy.deepcopy(cg_hf.enable(build("gpt2", layers=2)))
    model._set_gradient_checkpointing(enable=False)
    model.activation_checkpointing_enable()
    assert model.activation_checkpointing_enable.__self__ is model
    assert cg_hf.is_enabled(model)


def test_trainer_callback_enables_and_checks(tmp_path: Path) -> None:
    plain = build("llama", layers=2)
    model = copy.deepcopy(plain)
    ref_losses, _ = _train(plain, tmp_path / "plain", gc=False)
    args = _args(tmp_path / "cb")
    callback = cg_hf.CheckpointCallback(policy=cg.policies.save_matmuls())
    assert isinstance(callback, transformers.TrainerCallback)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_dataset(), callbacks=[callback]
    )
    trainer.train()
    assert cg_hf.is_enabled(model)
    assert [e["loss"] for e in trainer.state.log_history if "loss" in e] == ref_losses
    for name, ref in _params(plain).items():
        torch.testing.assert_close(_params(model)[name], ref, rtol=0, atol=0, msg=name)


def _hf_lines(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == logger and "ckpt_graph" in r.getMessage()
    ]


@pytest.mark.parametrize("how", ["gradient_checkpointing", "callback"])
def test_trainer_run_says_in_transformers_log_what_checkpoints(
    how: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # See Note [Integrations say when they are active]: with log_level="info" the Trainer
    # shows transformers' INFO lines; ckpt_graph's line is among them.
    model = build("gpt2", layers=2)
    extra: dict[str, Any] = {"log_level": "info", "max_steps": 1}
    callbacks = []
    if how == "gradient_checkpointing":
        cg_hf.enable(model, policy="must_save_all")
        extra["activation_checkpointing"] = True
    else:
        callbacks.append(cg_hf.CheckpointCallback(policy="must_save_all"))
    transformers_root = logging.getLogger("transformers")
    # transformers' root does not propagate by default, but an earlier test may have turned
    # propagation on: then caplog's root handler saw each line twice
    propagate, transformers_root.propagate = transformers_root.propagate, False
    transformers_root.addHandler(caplog.handler)
    try:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4, use_cpu=True,
            report_to=[], save_strategy="no", disable_tqdm=True, **extra,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=_dataset(), callbacks=callbacks
        )
        trainer.train()
    finally:
        transformers_root.removeHandler(caplog.handler)
        transformers_root.propagate = propagate
    line = (
        "ckpt_graph: transformers: GPT2LMHeadModel: 2 modules (GPT2Block x2) checkpoint "
        "through ckpt_graph regions (policy='must_save_all')"
    )
    where = (
        "transformers.modeling_utils" if how == "gradient_checkpointing" else "transformers.trainer"
    )
    assert _hf_lines(caplog, where) == [line]
