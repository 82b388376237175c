"""Your own GNN through train and soup (a two-layer ``MessagePassing`` model written here), and the GIN and APPNP
built-ins: trained, souped, loaded back and scored like ladle's own models, by whole-graph forwards."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TRUNKLESS, run_in_process
from torch import Tensor, nn
from torch_geometric.nn import GINConv, MessagePassing
from torch_geometric.utils import degree

import ladle
from ladle.core.errors import LadleError
from ladle.core.files import read_json
from ladle.core.recipe import load_recipe
from ladle.core.storage import load_state
from ladle.graph.inputs import graph_inputs
from ladle.graph.sparse import SparseMatrix
from ladle.nn.custom import CustomModel, import_model_class
from ladle.nn.models import build_model
from ladle.soup.evaluator import Evaluator

QUICK = [*TRUNKLESS, "view.kind=random", "epochs=30"]


class MeanConv(MessagePassing):
    """``h_i' = W_self h_i + W_neigh mean_{j -> i} h_j``: the user's own layer."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(aggr="mean")
        self.root, self.neighbours = nn.Linear(in_channels, out_channels), nn.Linear(in_channels, out_channels, bias=False)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        return self.root(x) + self.neighbours(self.propagate(edge_index, x=x))


class TwoLayerNet(nn.Module):
    """A user's model as PyG writes them: built from (in, out) sizes, ``forward(x, edge_index)``."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = MeanConv(in_channels, 32), MeanConv(32, out_channels)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        h = F.dropout(F.relu(self.conv1(x, edge_index)), 0.5, self.training)
        return self.conv2(h, edge_index)


class CountingNet(TwoLayerNet):
    """Holds an integer buffer, which no soup can average."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(in_channels, out_channels)
        self.register_buffer("seen", torch.zeros(3, dtype=torch.long))


def _accuracy(logits: Tensor, data, mask: str) -> float:
    chosen = data[mask]
    return float((logits.argmax(1)[chosen] == data.y[chosen]).float().mean())


@pytest.fixture(scope="module")
def custom_run(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("your-model") / "run"
    ladle.train_ingredients(load_recipe(None, QUICK), ingredients=2, workers=1, data_root=data_root,
                            run_dir=run_dir, model=TwoLayerNet)
    return run_dir


def test_your_model_trains_soups_and_loads_back(custom_run: Path, data_root: Path, cora_data) -> None:
    run = read_json(custom_run / "run.json")
    assert run["recipe"]["model"] == "custom" and "TwoLayerNet" not in (custom_run / "run.json").read_text()
    report = ladle.soup_run(custom_run, method="uniform", data_root=data_root, model=TwoLayerNet)
    assert report["forward"] == "whole-graph"
    (row,) = report["soups"]
    assert row["test_acc"] > 0.70  # a mean-aggregation GNN on Cora, 30 epochs, 2 ingredients averaged
    model = ladle.load_model(custom_run, "soup-uniform", model=TwoLayerNet)
    assert isinstance(model, TwoLayerNet) and not model.training
    with torch.no_grad():
        logits = model(cora_data.x, cora_data.edge_index)
    assert _accuracy(logits, cora_data, "test_mask") == pytest.approx(row["test_acc"])
    assert _accuracy(logits, cora_data, "val_mask") == pytest.approx(row["val_acc"])
    assert torch.equal(ladle.predict(custom_run, data_root=data_root, name="soup-uniform", model=TwoLayerNet), logits)
    # the uniform soup is the mean of the two ingredients' weights, under the module's own names
    states = [load_state(custom_run / f"ingredient-0{k}.safetensors") for k in range(2)]
    for key, value in model.state_dict().items():
        assert torch.allclose(value, (states[0][f"module.{key}"] + states[1][f"module.{key}"]) / 2)


def test_a_run_of_your_model_needs_its_class_and_refuses_another(custom_run: Path, data_root: Path) -> None:
    with pytest.raises(LadleError, match="your own class .*pass --model-class"):
        ladle.soup_run(custom_run, method="uniform", data_root=data_root, write=False)
    with pytest.raises(LadleError, match=r"does not match the run's recipe \(no module\.0\.weight\)"):
        ladle.load_model(custom_run, "ingredient-00", model=lambda i, o: nn.Sequential(nn.Linear(i, o)))
    gcn_run = custom_run.parent / "gcn"
    ladle.train_ingredients(load_recipe(None, [*QUICK, "epochs=1"]), ingredients=1, workers=1, data_root=data_root,
                            run_dir=gcn_run)
    with pytest.raises(LadleError, match="built-in gcn; --model-class"):
        ladle.load_model(gcn_run, "ingredient-00", model=TwoLayerNet)


def test_a_model_that_cannot_be_souped_is_refused_before_anything_is_written(data_root: Path, tmp_path: Path) -> None:
    with pytest.raises(LadleError, match=r"^the model's buffer 'seen' is torch.int64: a soup averages"):
        ladle.train_ingredients(load_recipe(None, QUICK), ingredients=2, data_root=data_root,
                                run_dir=tmp_path / "run", model=CountingNet)
    assert not (tmp_path / "run").exists()
    with pytest.raises(LadleError, match="returned a Parameter, not a torch.nn.Module"):
        CustomModel(lambda i, o: nn.Linear(i, o).weight, 4, 2)  # a tensor, not a module


def test_model_class_names_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for spec, message in (("nocolon", "takes package.module:Class"), ("no_such_module_x:Net", "cannot import"),
                          ("test_your_model:Missing", "has no Missing")):
        with pytest.raises(LadleError, match=message):
            import_model_class(spec)
    (tmp_path / "my_gnn.py").write_text("from torch import nn\nclass Net(nn.Linear):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    assert import_model_class("my_gnn:Net").__name__ == "Net"  # found in the working folder


def test_your_model_through_the_command_line(custom_run: Path, data_root: Path, tmp_path: Path) -> None:
    run = tmp_path / "cli"
    args = ["--data-root", str(data_root), "--run-dir", str(run), "-k", "2", "-w", "1", *QUICK, "epochs=2"]
    result = run_in_process("ladle.train", *args, "--model-class", "test_your_model:TwoLayerNet")
    assert result.returncode == 0, result.stderr
    refused = run_in_process("ladle.soup", "--run-dir", str(run), "--data-root", str(data_root))
    assert refused.returncode != 0 and "pass --model-class" in refused.stderr
    souped = run_in_process("ladle.soup", "--run-dir", str(run), "--data-root", str(data_root), "--method", "uniform",
                            "--model-class", "test_your_model:TwoLayerNet")
    assert souped.returncode == 0, souped.stderr
    assert "no layer-wise inference in ladle" in souped.stdout


@pytest.mark.parametrize("kind", ["gin", "appnp"])
def test_gin_and_appnp_train_and_soup(kind: str, data_root: Path, cora_data, tmp_path: Path) -> None:
    recipe = load_recipe(None, [*QUICK, f"model={kind}"])
    ladle.train_ingredients(recipe, ingredients=2, workers=1, data_root=data_root, run_dir=tmp_path / kind)
    report = ladle.soup_run(tmp_path / kind, method="uniform", data_root=data_root)
    (row,) = report["soups"]
    assert report["forward"] == "whole-graph" and row["test_acc"] > 0.65  # 30 epochs on half of Cora each: 0.70-0.72
    logits = ladle.predict(tmp_path / kind, cora_data, name="soup-uniform")
    assert _accuracy(logits, cora_data, "test_mask") == pytest.approx(row["test_acc"])


@pytest.mark.parametrize("kind", ["gin", "appnp"])
def test_gin_and_appnp_project_sparse_features_first_to_the_same_logits(kind: str, cora_data) -> None:
    """Cora's bag of words goes in sparse (projected before GIN's sum), with the dense forward's outputs and
    gradients, and the parameters PyG's layers have."""
    recipe = load_recipe(None, [*QUICK, f"model={kind}", "layers=3"])
    torch.manual_seed(0)
    net = build_model(recipe, cora_data.num_features, 7)
    sparse, dense = (graph_inputs(cora_data, kind, sparse_features=flag) for flag in (True, False))
    assert isinstance(graph_inputs(cora_data, kind).x, SparseMatrix)
    outputs, gradients = [], []
    for inputs in (sparse, dense):
        torch.manual_seed(1)  # the same dropout masks
        net.zero_grad()
        logits = net(inputs)
        logits.square().sum().backward()
        outputs.append(logits.detach())
        gradients.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5) and torch.allclose(gradients[0], gradients[1], atol=1e-3)
    reference = {"gin": GINConv, "appnp": nn.Linear}[kind]
    assert all(isinstance(conv, reference) for conv in net.convs)


@pytest.mark.parametrize("kind", ["gin", "appnp"])
def test_gin_and_appnp_score_the_same_on_the_neighbourhood_and_the_whole_graph(kind: str, cora_data) -> None:
    """The soups' validation (the validation nodes' L-hop sub-graph) equals the whole graph's figure: exact."""
    recipe = load_recipe(None, [*QUICK, f"model={kind}", "layers=3"])
    torch.manual_seed(0)
    evaluator = Evaluator(recipe, cora_data, layerwise=True)
    assert not evaluator.layerwise  # no layer-wise path for these: whole-graph forwards
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in evaluator.model.state_dict().items()}
    whole = evaluator.split(state, "val_mask")
    sub = Evaluator(recipe, cora_data).validation(state)
    assert sub.acc == pytest.approx(whole.acc) and sub.loss == pytest.approx(whole.loss, rel=1e-5)
    counts = degree(cora_data.edge_index[1], cora_data.num_nodes)
    assert counts.min() > 0  # every node aggregates something: the check above is not vacuous
