# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ruff: noqa: B010  (the copied code sets its layers with setattr)
"""What Lightning's own tests of gradient clipping import from its test helpers, copied from
https://github.com/Lightning-AI/pytorch-lightning (tag 2.6.5, Apache-2.0), with the fixture that
runs them with gradfuse's callback.

Copied unchanged: ``RunIf`` (tests/tests_pytorch/helpers/runif.py), ``SklearnDataset``
(helpers/datasets.py), ``SklearnDataModule`` and ``ClassifDataModule`` (helpers/datamodules.py),
``ClassificationModel`` (helpers/simple_models.py). gradfuse's own part is
``gradfuse_in_every_trainer``, at the end.
"""
import operator

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.core.datamodule import LightningDataModule
from lightning.pytorch.utilities.testing import _runif_reasons
from lightning_utilities.core.imports import RequirementCache, compare_version
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset
from torchmetrics import Accuracy

from gradfuse.integrations.lightning import GradfuseCallback

_SKLEARN_AVAILABLE = RequirementCache("scikit-learn")
# using new API with task
_TM_GE_0_11 = compare_version("torchmetrics", operator.ge, "0.11.0")


def RunIf(**kwargs):
    reasons, marker_kwargs = _runif_reasons(**kwargs)
    return pytest.mark.skipif(condition=len(reasons) > 0, reason=f"Requires: [{' + '.join(reasons)}]", **marker_kwargs)


class SklearnDataset(Dataset):
    def __init__(self, x, y, x_type, y_type):
        self.x = x
        self.y = y
        self._x_type = x_type
        self._y_type = y_type

    def __getitem__(self, idx):
        return torch.tensor(self.x[idx], dtype=self._x_type), torch.tensor(self.y[idx], dtype=self._y_type)

    def __len__(self):
        return len(self.y)


class SklearnDataModule(LightningDataModule):
    def __init__(self, sklearn_dataset, x_type, y_type, batch_size: int = 10):
        if not _SKLEARN_AVAILABLE:
            raise ImportError(str(_SKLEARN_AVAILABLE))

        super().__init__()
        self.batch_size = batch_size
        self._x, self._y = sklearn_dataset
        self._split_data()
        self._x_type = x_type
        self._y_type = y_type

    def _split_data(self):
        from sklearn.model_selection import train_test_split

        self.x_train, self.x_test, self.y_train, self.y_test = train_test_split(
            self._x, self._y, test_size=0.20, random_state=42
        )
        self.x_train, self.x_valid, self.y_train, self.y_valid = train_test_split(
            self.x_train, self.y_train, test_size=0.40, random_state=42
        )

    def train_dataloader(self):
        return DataLoader(
            SklearnDataset(self.x_train, self.y_train, self._x_type, self._y_type),
            batch_size=self.batch_size,
        )

    def val_dataloader(self):
        return DataLoader(
            SklearnDataset(self.x_valid, self.y_valid, self._x_type, self._y_type), batch_size=self.batch_size
        )

    def test_dataloader(self):
        return DataLoader(
            SklearnDataset(self.x_test, self.y_test, self._x_type, self._y_type), batch_size=self.batch_size
        )

    def predict_dataloader(self):
        return DataLoader(
            SklearnDataset(self.x_test, self.y_test, self._x_type, self._y_type), batch_size=self.batch_size
        )

    @property
    def sample(self):
        return torch.tensor([self._x[0]], dtype=self._x_type)


class ClassifDataModule(SklearnDataModule):
    def __init__(
        self, num_features=32, length=800, num_classes=3, batch_size=10, n_clusters_per_class=1, n_informative=2
    ):
        if not _SKLEARN_AVAILABLE:
            raise ImportError(str(_SKLEARN_AVAILABLE))

        from sklearn.datasets import make_classification

        data = make_classification(
            n_samples=length,
            n_features=num_features,
            n_classes=num_classes,
            n_clusters_per_class=n_clusters_per_class,
            n_informative=n_informative,
            random_state=42,
        )
        super().__init__(data, x_type=torch.float32, y_type=torch.long, batch_size=batch_size)




class ClassificationModel(LightningModule):
    def __init__(self, num_features=32, num_classes=3, lr=0.01):
        super().__init__()

        self.lr = lr
        for i in range(3):
            setattr(self, f"layer_{i}", nn.Linear(num_features, num_features))
            setattr(self, f"layer_{i}a", torch.nn.ReLU())
        setattr(self, "layer_end", nn.Linear(num_features, 3))

        acc = Accuracy(task="multiclass", num_classes=num_classes) if _TM_GE_0_11 else Accuracy()
        self.train_acc = acc.clone()
        self.valid_acc = acc.clone()
        self.test_acc = acc.clone()

    def forward(self, x):
        x = self.layer_0(x)
        x = self.layer_0a(x)
        x = self.layer_1(x)
        x = self.layer_1a(x)
        x = self.layer_2(x)
        x = self.layer_2a(x)
        x = self.layer_end(x)
        return F.softmax(x, dim=1)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        return [optimizer], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.forward(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc(logits, y), prog_bar=True)
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.forward(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=False)
        self.log("val_acc", self.valid_acc(logits, y), prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self.forward(x)
        self.log("test_loss", F.cross_entropy(logits, y), prog_bar=False)
        self.log("test_acc", self.test_acc(logits, y), prog_bar=True)

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self.forward(x)


@pytest.fixture(autouse=True)
def gradfuse_in_every_trainer(monkeypatch, tmp_path):
    """Every ``Trainer`` a test builds gets a ``GradfuseCallback`` after its own callbacks;
    torch's clipping functions, which Lightning clips with, must not run (gradfuse makes each clip
    that Lightning's clipping path asks for), and each finished fit must have run the monitor. Yields the
    callbacks made. Runs in ``tmp_path`` (some tests build a Trainer without
    ``default_root_dir``)."""
    made, trainers, torch_clips = [], [], []
    init = Trainer.__init__

    def __init__(self, *args, callbacks=None, **kwargs):
        callback = GradfuseCallback()
        made.append(callback)
        trainers.append((self, callback))
        own = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
        init(self, *args, callbacks=[*own, callback], **kwargs)

    monkeypatch.setattr(Trainer, "__init__", __init__)

    def spy(name):
        clip = getattr(torch.nn.utils, name)

        def clip_and_note(*args, **kwargs):
            torch_clips.append(name)
            return clip(*args, **kwargs)
        return clip_and_note

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        monkeypatch.setattr(torch.nn.utils, name, spy(name))
    monkeypatch.chdir(tmp_path)
    yield made
    assert not torch_clips, f"Lightning clipped with torch.nn.utils.{torch_clips[0]}: gradfuse did not"
    for trainer, callback in trainers:  # each fit that finished ran the monitor at every step
        state = getattr(trainer, "state", None)  # None: the Trainer refused its arguments
        if state is not None and state.finished and trainer.global_step:
            assert callback.monitors and all(mon.step_count > 0 for mon in callback.monitors.values())
