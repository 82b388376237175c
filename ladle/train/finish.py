"""What every training loop shares around its epochs (an ingredient's, periodic averaging's, varrate's rank 0):
a progress bar and curve loggers closed however the loop ends, then one finish: the kept weights loaded,
scored, saved, their metadata written and the run's curves merged."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch_geometric.data import Data
from tqdm import tqdm

from ladle.core.files import write_json
from ladle.core.resources import peak_rss_mb
from ladle.core.storage import StateDict, save_state
from ladle.graph.inputs import GraphInputs
from ladle.nn.models import GNN
from ladle.nn.scoring import evaluate
from ladle.train.curves import EpochLogger, merge_metrics


@contextmanager
def epoch_loop(run_dir: Path | None, name: str, role: str, loggers: Sequence[str], epochs: int, first_epoch: int = 0,
               desc: str = "", position: int = 0, show: bool = True) -> Iterator[tuple[tqdm, EpochLogger | None]]:
    """A loop's progress bar over ``epochs`` (from ``first_epoch``, a resumed one) and its curve loggers (None
    without a ``run_dir``), both closed however the loop ends: done, a NaN loss, a peer's failure, Ctrl-C."""
    bar = tqdm(total=epochs, initial=first_epoch, desc=desc or name, position=position, leave=False,
               dynamic_ncols=True, disable=None if show else True)
    curves = None
    try:
        curves = EpochLogger(run_dir, name, role, loggers, first_epoch) if run_dir is not None else None
        yield bar, curves
    finally:
        bar.close()
        if curves is not None:
            curves.close()


def finish(model: GNN, kept: StateDict | None, weights: Path, meta_path: Path, meta: dict[str, Any],
           scored_on: tuple[GraphInputs, Data] | None = None, curves_of: Path | None = None) -> dict[str, Any]:
    """End a loop: load its ``kept`` weights (None: the model's own), score them on ``scored_on``'s validation
    and test nodes (the whole graph, when the loop has it), save them to ``weights``, write ``meta`` with the
    scores, the process's peak memory and ``status: done`` to ``meta_path``, and merge the curves of the run
    ``curves_of``; return the metadata."""
    if kept is not None:
        model.load_state_dict(kept)
    if scored_on is not None:
        inputs, data = scored_on
        device = next(model.parameters()).device
        y = data.y.to(device)
        val = evaluate(model, inputs, y, data.val_mask.to(device))
        test = evaluate(model, inputs, y, data.test_mask.to(device))
        meta = meta | {"val_acc": val.acc, "val_loss": val.loss, "test_acc": test.acc}
    meta = meta | {"peak_rss_mb": peak_rss_mb(), "threads": torch.get_num_threads(), "status": "done"}
    save_state(weights, model.state_dict())
    write_json(meta_path, meta)
    if curves_of is not None:
        merge_metrics(curves_of)
    return meta
