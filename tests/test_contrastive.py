"""The contrastive task (gaexp/task/contrastive.py) as a config choice: its keys and what they refuse, the model it
trains (the network and a projection head), its k-NN evaluation against a classifier computed by hand, and a sweep
through the public command: both negatives recorded, the engine each used, the report's rows norm-negatives.
(The engines' arithmetic: tests/test_cached.py.)"""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient
from torch import nn

from gaexp.config import TaskConfig, compose_config, typed
from gaexp.precision import Precision
from gaexp.task.build import problem
from gaexp.task.contrastive import Contrastive, Embedder


def test_negatives_are_a_contrastive_tasks_key_and_no_other_tasks():
    assert TaskConfig(name="contrastive", loss="info_nce", negatives="micro").negatives == "micro"
    with pytest.raises(ValueError, match=r"^task.negatives='none'; valid: micro or step \(for task.name=contrastive\)$"):
        TaskConfig(name="contrastive", loss="info_nce")
    with pytest.raises(ValueError, match=r"^task.negatives='step'; valid: none \(in-batch negatives are a contrastive "):
        TaskConfig(name="classify", negatives="step")
    with pytest.raises(ValueError, match=r"^task.loss='cross_entropy'; valid: info_nce \(for task.name=contrastive\)$"):
        TaskConfig(name="contrastive", negatives="step")


def test_the_task_refuses_text_and_negatives_step_across_replicas_in_one_line(data_root):
    text = typed(compose_config(["task=contrastive", "data=fortunes", f"data.root={data_root}"], hydra=False))
    assert problem(text) == ("data=fortunes is text (data.kind=text), and task=contrastive takes images; valid: task=lm "
                             "model=gpt norm=ln with data=fortunes")
    dp = typed(compose_config(["task=contrastive", "regime.batch_size=4", "regime.num_accum=2", "regime.replicas=2",
                               f"data.root={data_root}"], hydra=False))
    assert problem(dp) == ("task.negatives=step normalizes each view over the whole step's views, and under "
                           "regime.replicas=2 each replica holds only its share of them; valid: regime.replicas=1, or "
                           "task.negatives=micro")
    micro = typed(compose_config(["task=contrastive", "task.negatives=micro", "regime.batch_size=4",
                                  "regime.num_accum=2", "regime.replicas=2", f"data.root={data_root}"], hydra=False))
    assert problem(micro) is None


def test_the_model_is_the_network_its_representation_and_a_projection_head(data_root):
    from gaexp.model import make_model
    c = typed(compose_config(["task=contrastive", "norm=gn4", f"data.root={data_root}"], hydra=False))
    model = make_model(c, 1, 10)
    assert isinstance(model, Embedder) and model.network.fc.out_features == 128  # task.features
    out = model(torch.zeros(6, 1, 28, 28).contiguous(memory_format=torch.channels_last))
    assert out.shape == (6, 64) and model.represent(torch.zeros(2, 1, 28, 28)).shape == (2, 128)
    assert c.run_name == "info_nce-negatives_step-gn4-bs16a1-s1"


def test_the_knn_classifier_is_the_majority_of_the_nearest_bank_images(train_split, valid_split):
    """With the flattened image as the representation, valid_acc is the k-NN accuracy computed here by hand: cosine
    similarity to each of the bank's images, the k nearest, their most frequent label (a tie: the lowest)."""
    task = Contrastive("step", knn_k=5, knn_bank=300)
    task.prepare(train_split)
    model = Embedder(nn.Flatten(), 784, 8)
    valid = valid_split.take(slice(0, 200))
    got = task.evaluate(model, valid, 64, Precision.float32())
    bank = nn.functional.normalize(train_split.inputs(slice(0, 300)).flatten(1), dim=1)
    queries = nn.functional.normalize(valid.inputs(slice(None)).flatten(1), dim=1)
    nearest = (queries @ bank.T).topk(5, dim=1).indices
    labels = train_split.labels[:300][nearest]
    by_hand = [int(torch.bincount(row, minlength=10).argmax()) for row in labels]
    expected = sum(p == y for p, y in zip(by_hand, valid.labels.tolist())) / 200
    assert got == {"valid_acc": expected} and expected > 0.7  # MNIST's pixels alone classify well by k-NN
    assert model.training  # evaluation left the module as it was


def test_evaluation_before_prepare_names_the_missing_bank(valid_split):
    with pytest.raises(RuntimeError, match=r"before prepare\(train_data\)"):
        Contrastive("step").evaluate(Embedder(nn.Flatten(), 784, 8), valid_split.take(slice(0, 4)), 4,
                                     Precision.float32())


@pytest.mark.slow
def test_a_contrastive_sweep_through_the_public_command_records_both_negatives(tmp_path, gaexp_command):
    """norm=gn4 at 4 images x 2 micro-batches under the cached engine, with each micro-batch's negatives and the
    step's: each cell FINISHED with its task keys, holding one micro-batch's activations, reported in rows gn4-micro
    and gn4-step with the k-NN accuracy as the headline."""
    proc = gaexp_command(tmp_path, "task=contrastive", "norm=gn4", "regime=bs4a4", "regime.num_accum=2",
                         "task.negatives=micro,step", "accumulate=cached", "task.knn_bank=500",
                         "analysis.rows=norm+task.negatives", "analysis.table_columns=[bs4a2]",
                         "analysis.reference=bs4a2", "analysis.ranked_regime=bs4a2", "analysis.baselines=[]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = {r.info.run_name: r for r in client.search_runs(client.get_experiment_by_name("gaexp").experiment_id)
            if "norm" in r.data.tags}
    assert sorted(runs) == ["info_nce-negatives_micro-cached-gn4-bs4a2-s1", "info_nce-negatives_step-cached-gn4-bs4a2-s1"]
    for name, run in runs.items():
        assert run.info.status == "FINISHED" and 0 <= run.data.metrics["final_valid_acc"] <= 1, name
        assert run.data.params["task.name"] == "contrastive" and run.data.params["task.temperature"] == "0.2"
        assert run.data.metrics["activation_mb"] > 0 and "batched_activation_mb" not in run.data.metrics
    table = next((tmp_path / "reports").glob("*/table.md")).read_text()
    assert table.startswith("mnist: mean valid accuracy (%) over evaluations at step > 0"), table
    assert "| norm-negatives | bs4a2 |" in table and "| gn4-micro | " in table and "| gn4-step | " in table
