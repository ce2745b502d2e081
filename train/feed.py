"""The steps' data: rank 0 reads the demo corpus with ``FlowDataLoader`` and every rank gets
each step's packs by broadcast, so both runs (and every stage of them) see the same samples.

One decoding process for the whole world is enough for this tiny model; the loader's own
broadcast (:mod:`mindspeed_flow.data.broadcast`) sends each pack's tensors and sample ids.
A step is ``data.packs_per_step`` consecutive packs; an epoch that ends inside a step
continues with the next epoch.  ``state_dict`` is the loader's resumable state (rank 0's
holds the data position; the others only their settings) plus the step count, so a resumed
feed yields exactly the steps the uninterrupted one would have, no sample twice.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

if TYPE_CHECKING:
    from mindspeed_flow.train.config import TrainConfig
    from mindspeed_flow.train.launch import DistEnv

SOURCE_RANK = 0


@dataclass
class StepData:
    """One step's global batch, identical on every rank."""

    step: int  # 1-based global step
    packs: list[dict]  # collate_pack dicts, tensors on the rank's device
    loss_tokens: int  # batches.count_loss_tokens(packs): the loss denominator of the step
    ahead: Optional["StepData"] = None  # the next step's data (a lookahead feed), for a producer running ahead

    @property
    def sample_ids(self) -> list[str]:
        return [sid for pack in self.packs for sid in pack["sample_ids"]]


def ensure_corpus(cfg: "TrainConfig") -> Path:
    """The corpus directory of ``cfg.data``.  When it does not exist: made with
    ``make_demo_corpus`` (the demo corpus of ``data.samples`` records and ``data.seed``) if
    the config says ``data.make_demo: true``, else :class:`ConfigError` naming the path (a
    typo in ``data.path`` must not train on generated data).

    Several processes may get here at once (every rank under torchrun): each writes a
    private copy and renames it into place; the first rename wins, the others are dropped
    (the corpus is deterministic, so every copy is the same)."""
    from mindspeed_flow.data.demo import make_demo_corpus
    from mindspeed_flow.train.config import ConfigError

    path = Path(cfg.data.path)
    if path.exists():
        if not any(path.glob("*.json*")):
            raise ConfigError(f"data.path: {path} exists but holds no .json/.jsonl corpus shards")
        return path
    if not cfg.data.make_demo:
        raise ConfigError(f"data.path: {path} does not exist ({path.resolve()}); fix the path, or set "
                          "data.make_demo: true to make the demo corpus there")
    path.parent.mkdir(parents=True, exist_ok=True)
    private = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        make_demo_corpus(private, samples=cfg.data.samples, seed=cfg.data.seed)
        os.rename(private, path)
    except OSError:
        if not path.exists():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return path


def with_tokenizer(cfg: "TrainConfig") -> "TrainConfig":
    """``cfg`` with ``model.vocab_size`` and ``model.image_token_id`` taken from the corpus's
    tokenizer where the config leaves them unset (0 / -1)."""
    from mindspeed_flow.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None, ensure_corpus(cfg))
    backend = tokenizer.backend
    vocab = backend.get_vocab_size(with_added_tokens=True) if tokenizer.fast else len(backend)
    model = cfg.model
    model = dataclasses.replace(model, vocab_size=model.vocab_size if model.vocab_size > 0 else vocab,
                                image_token_id=model.image_token_id if model.image_token_id >= 0
                                else tokenizer.special.image_pad)
    return dataclasses.replace(cfg, model=model)


class StepFeed:
    """``next()`` gives the next :class:`StepData`; call it on every rank in the same order.

    ``lookahead``: each step also carries the next step's data (``StepData.ahead``), read one
    step early, for the flow's frozen encoder that runs ahead; ``state_dict`` is still the
    position right after the step handed out, so a resumed feed reads the looked-ahead step
    again (none lost, none twice)."""

    def __init__(self, cfg: "TrainConfig", env: "DistEnv", *, lookahead: bool = False) -> None:
        import torch.distributed as dist

        from mindspeed_flow.data import FlowDataLoader

        self.cfg, self.env = cfg, env
        self.step = 0
        if env.rank == SOURCE_RANK:
            ensure_corpus(cfg)
        group = dist.group.WORLD if env.world_size > 1 else None
        self.loader = FlowDataLoader(
            cfg.data.path, None, capacity=cfg.data.capacity, dp_rank=0, dp_size=1,
            num_workers=cfg.data.num_workers, seed=cfg.seed, step_packs=cfg.data.packs_per_step,
            group=group, src=SOURCE_RANK if group is not None else None, device=env.device,
            max_pixels=cfg.data.max_pixels, cost_model=cfg.data.llm_cost_model())
        self._packs: Optional[Iterator[dict[str, Any]]] = None
        self.lookahead = lookahead
        self._next: Optional[StepData] = None  # read ahead, not handed out yet
        self._position: Optional[dict[str, Any]] = None  # the loader's state right after step ``self.step``

    def _next_pack(self) -> dict[str, Any]:
        for _ in range(2):  # an exhausted epoch is followed by the next one
            if self._packs is None:
                self._packs = iter(self.loader)
            pack = next(self._packs, None)
            if pack is not None:
                return pack
            self._packs = None
        raise RuntimeError(f"the corpus {self.cfg.data.path} gave no pack in a whole epoch "
                           "(every sample bad or overlong? see the loader's warnings)")

    def next(self) -> StepData:
        if not self.lookahead:
            data = self._read(self.step + 1)
        else:
            data = self._next or self._read(self.step + 1)
            self._position = self.loader.state_dict()
            data.ahead = self._next = self._read(self.step + 2)
        self.step = data.step
        return data

    def _read(self, step: int) -> StepData:
        from mindspeed_flow.train.batches import count_loss_tokens

        packs = [self._on_device(self._next_pack()) for _ in range(self.cfg.data.packs_per_step)]
        return StepData(step=step, packs=packs, loss_tokens=count_loss_tokens(packs))

    def _on_device(self, pack: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.env.device) if hasattr(v, "to") else v for k, v in pack.items()}

    def state_dict(self) -> dict[str, Any]:
        position = self._position if self.lookahead and self._position is not None else self.loader.state_dict()
        return {"step": self.step, "loader": position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        self.step = int(state["step"])
        self._packs = None  # the next pack comes from the restored position
        self._next = self._position = None
