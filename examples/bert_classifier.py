"""The BERT write-up's text classifier, both ways: `model.fit`, and a custom training loop.

    KERAS_BACKEND=jax python examples/bert_classifier.py --loop fit
    KERAS_BACKEND=tensorflow python examples/bert_classifier.py --loop custom --virtual-devices 8

The model is keras-hub's `BertTextClassifier` with its preprocessor: raw strings in. Nothing
is downloaded. By default it is a small BERT built from a configuration over a local
vocabulary, trained on a small text set made here, whose label is the topic of its words (a
real model learns it within an epoch or two). `--data FILE` reads your own: one example per
line, `label<TAB>text`, labels 0..K-1, the last fifth held out for validation. `--preset`
loads real BERT weights from a local keras-hub preset directory (or the kagglehub cache);
when they are not on disk it says where it looked.

Both paths follow the seed: Adam with epsilon 1e-8, sparse categorical cross-entropy on
logits averaged over the global batch, a global batch of 16 split over the replicas, loss
and accuracy per epoch; the custom loop resets its metrics every epoch and backs up its
state every epoch (the seed's CheckpointManager(max_to_keep=5)); `fit` saves the weights to
`.weights.h5` at the end, as the seed does.

Needs the `nlp` extra (keras-hub, with tensorflow-text), beyond README's first set-up
command: pip install -c constraints.txt -e ".[jax,tensorflow,nlp]" (or its second, `all`).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def read_tsv(path: str):
    """`(texts, labels)` from lines of `label<TAB>text`."""
    import numpy as np

    texts, labels = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            label, sep, text = line.partition("\t")
            if not sep or not label.strip().isdigit():
                raise SystemExit(
                    f"{path}:{number}: expected 'label<TAB>text' with an integer label. "
                    f"Received: {line[:80]!r}"
                )
            labels.append(int(label))
            texts.append(text)
    if len(texts) < 10:
        raise SystemExit(f"{path}: {len(texts)} examples; give at least 10.")
    return np.array(texts, dtype=str), np.array(labels, dtype="int32")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", choices=["fit", "custom"], default="fit")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512, help="made-up training examples")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (the write-up's)")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="default 3e-5 with --preset (the write-up's), else 3e-3")  # fmt: skip
    parser.add_argument("--sequence-length", type=int, default=32)
    parser.add_argument("--data", default=None, help="a label<TAB>text file of your own")
    parser.add_argument("--preset", default=None, help="a local keras-hub BERT preset")
    parser.add_argument("--devices", type=int, default=None, help="use the first N devices")
    parser.add_argument("--virtual-devices", type=int, default=None,
                        help="split the CPU into N devices first")  # fmt: skip
    parser.add_argument("--output", default=None, help="where checkpoints and weights go")
    args = parser.parse_args()

    import keras_accel

    if args.virtual_devices:
        keras_accel.configure_virtual_cpu_devices(args.virtual_devices)
    import keras
    import numpy as np

    from keras_accel import Accelerator
    from keras_accel.callbacks import BackupAndRestore
    from keras_accel.data import synthetic_text_classification
    from keras_accel.models import bert_classifier

    if args.data:
        texts, labels = read_tsv(args.data)
        cut = int(len(texts) * 0.8)
        (x, y), (x_val, y_val) = (texts[:cut], labels[:cut]), (texts[cut:], labels[cut:])
        source = args.data
    else:
        (x, y), (x_val, y_val) = synthetic_text_classification(
            args.samples, max(args.samples // 4, 16), num_classes=3
        )
        source = "synthetic topic sentences (keras_accel.data.synthetic_text_classification)"
    classes = int(max(y.max(), y_val.max())) + 1

    acc = Accelerator(devices=args.devices, seed=0)
    print(f"backend:  {acc.backend}, {acc.strategy_name} over {acc.num_replicas} replica(s)")
    print(f"data:     {source}: {len(x)} train, {len(x_val)} validation, {classes} classes")
    with acc.scope():
        try:
            if args.preset:
                model = bert_classifier(classes, preset=args.preset,
                                        sequence_length=args.sequence_length)  # fmt: skip
            else:
                model = bert_classifier(
                    classes,
                    sequence_length=args.sequence_length,
                    num_layers=2,
                    hidden_dim=64,
                    num_heads=2,
                    intermediate_dim=128,
                )
        except FileNotFoundError as error:
            raise SystemExit(f"bert_classifier: {error}") from None
        rate = args.learning_rate or (3e-5 if args.preset else 3e-3)
        model.compile(
            optimizer=keras.optimizers.Adam(rate, epsilon=1e-8),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")],
        )
    print(f"model:    BertTextClassifier, {model.count_params():,} parameters, lr {rate}")
    output = args.output or tempfile.mkdtemp(prefix="bert_classifier-")

    started = time.perf_counter()
    if args.loop == "fit":
        history = acc.fit(
            model, x, y, batch_size=args.batch_size, epochs=args.epochs,
            validation_data=(x_val, y_val), verbose=0,
        )  # fmt: skip
        for epoch in range(args.epochs):
            row = {k: v[epoch] for k, v in history.history.items()}
            print(
                f"epoch {epoch + 1}: loss {row['loss']:.4f}, accuracy {row['accuracy']:.4f}, "
                f"val_loss {row['val_loss']:.4f}, val_accuracy {row['val_accuracy']:.4f}"
            )
        val_accuracy = history.history["val_accuracy"][-1]
        model.save_weights(os.path.join(output, "bert_classifier.weights.h5"))
    else:
        # The seed's custom loop, on every backend: the loss averaged over the global
        # batch, loss and accuracy printed and reset every epoch, a checkpoint every epoch.
        loop = acc.loop(model, metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")])
        backup = BackupAndRestore(os.path.join(output, "checkpoints"), max_to_keep=5)
        callbacks = loop.callbacks([backup], epochs=args.epochs)
        callbacks.on_train_begin()
        for epoch in range(loop.initial_epoch, args.epochs):
            callbacks.on_epoch_begin(epoch)
            loop.reset_metrics()
            for step, batch in enumerate(
                loop.batches(x, y, batch_size=args.batch_size, shuffle=True, epoch=epoch)
            ):
                callbacks.on_train_batch_begin(step)
                loop.train_step(batch)
                callbacks.on_train_batch_end(step)
            train = loop.results()
            val = loop.evaluate(x_val, y_val, batch_size=args.batch_size)
            callbacks.on_epoch_end(epoch, {**train, **{f"val_{k}": v for k, v in val.items()}})
            print(
                f"epoch {epoch + 1}: loss {train['loss']:.4f}, accuracy "
                f"{train['accuracy']:.4f}, val_loss {val['loss']:.4f}, val_accuracy "
                f"{val['accuracy']:.4f}"
            )
            val_accuracy = val["accuracy"]
        callbacks.on_train_end()
    seconds = time.perf_counter() - started
    chance = 1.0 / classes
    logits = acc.predict(model, x_val[:4], verbose=0)
    probabilities = keras.ops.convert_to_numpy(keras.ops.softmax(logits))
    print(f"predict:  {str(x_val[0])!r} -> class {int(np.argmax(probabilities[0]))} "
          f"(label {int(y_val[0])})")  # fmt: skip
    print(
        f"result:   val_accuracy {val_accuracy:.4f} (chance {chance:.4f}) in {seconds:.1f} s; "
        f"{'learned' if val_accuracy > chance + 0.2 else 'NOT LEARNED'}; files in {output}"
    )
    return 0 if val_accuracy > chance + 0.2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
