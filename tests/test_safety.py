"""Safety: checkpoints load with Keras' safe_mode, files go only where the user said, and the
launcher binds to loopback (tested in test_faults.py)."""

import tempfile
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import cpus
from models import BATCH, dense_data, dense_model

import kmirror

PACKAGE = Path(kmirror.__file__).parent


def test_kmirror_never_turns_keras_safe_mode_off():
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    assert "safe_mode=False" not in source
    assert "enable_unsafe_deserialization" not in source


def test_a_checkpoint_with_code_in_it_is_refused_when_loaded(tmp_path):
    """A Lambda layer is arbitrary Python: Keras refuses to load it in safe mode, and a checkpoint
    written by kmirror gets no exception from that."""
    model = keras.Sequential([keras.Input((8,)), keras.layers.Lambda(lambda t: t * 2)])
    model.add(keras.layers.Dense(3))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    wrapped = kmirror.wrap(model, devices=cpus(2))
    x, y = dense_data()
    path = tmp_path / "lambda.keras"
    checkpoint = kmirror.callbacks.ChiefCheckpoint(path)
    wrapped.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[checkpoint])
    assert path.exists()
    with pytest.raises(ValueError, match="safe_mode"):
        keras.models.load_model(path)


def test_files_are_written_only_where_the_user_said(tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    # A temporary folder of this test's own: what is left in it was left by this training.
    temporary = tmp_path_factory.mktemp("temporary")
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    wrapped = kmirror.wrap(dense_model(), devices=cpus(2))
    x, y = dense_data()
    wrapped.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        validation_split=0.2,
        callbacks=[
            kmirror.callbacks.ChiefCheckpoint(run / "best.keras", save_best_only=True),
            kmirror.callbacks.ChiefTensorBoard(run / "logs"),
            kmirror.callbacks.BackupAndRestore(run / "backup"),
        ],
    )
    wrapped.save(run / "final.keras")
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
    assert sorted(p.name for p in run.iterdir()) == ["best.keras", "final.keras", "logs"]
    assert list(temporary.iterdir()) == [], "temporary files are removed"
    assert np.isfinite(wrapped.evaluate(x, y, verbose=0)).all()
