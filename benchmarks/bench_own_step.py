"""Models with their own train_step: kmirror against native MirroredStrategy running the same step.

Three programs, each the same Keras model class on both sides, on 2 simulated devices: two of
keras.io's generative and self-supervised half, and differentially private training:

- `dcgan`: a DCGAN-like step (64x64x3 images, batch 64): a convolutional generator and
  discriminator, two optimizers, two gradient steps per batch;
- `simclr`: a SimCLR-like contrastive step (batch 64): two noisy views through an encoder, an
  InfoNCE loss over every row of the batch;
- `dpsgd`: DP-SGD on a small convolutional network (28x28x1 images, batch 64): each row's
  gradient by `tf.vectorized_map`, clipped, summed, noised; also against one device (kmirror
  maps each replica's rows; native MirroredStrategy runs the step on each replica's rows).

kmirror runs the step on the whole batch on every replica, each layer call on the replica's rows
(the step computes what one device computes); native MirroredStrategy runs it on each replica's
rows and sums the gradients (each replica's contrastive loss then sees its rows only).

Time: both fit in one process on the same devices, interleaved rounds, medians. Peak memory:
each side in its own child process, the peak of TensorFlow's allocator for tensors during a
training step (`TF_CPU_ALLOCATOR_USE_BFC=true`), the median over the steps of 2 epochs, then over
`--memory-runs` children. Simulated devices share one host allocator, which counts whatever the
replicas hold at the same moment: on GPUs each replica's pass runs at once, on a device of its
own. So each child runs with enough inter-op threads (`THREADS_PER_REPLICA` per replica) that the
replicas' passes run at once on both sides, as on devices, and its figure is their sum. (With
fewer threads than replicas need, native MirroredStrategy's replicas may run one after another
and count one replica's activations at a time; kmirror's replicas meet at every layer call's
join, so theirs always overlap.)

Writes `"own_step": {"dcgan": {"time": r, "peak_memory": r, ...}, "simclr": {...}, "dpsgd":
{..., "time_one_device": r}}` to benchmarks/results.json.

    python benchmarks/bench_own_step.py [--devices 2] [--rounds 3] [--batches 4] [--memory-runs 5]
        [--programs dcgan,simclr,dpsgd]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

BATCH, SIZE, LATENT = 64, 64, 64
#: Inter-op threads per replica in a memory child: enough that the replicas' passes overlap.
THREADS_PER_REPLICA = 4
SIDES = ("kmirror", "native")
PROGRAMS = ("dcgan", "simclr", "dpsgd")
#: The programs also measured on one device (their per-row work split over the replicas).
ONE_DEVICE = ("dpsgd",)


def dcgan():
    import keras
    import tensorflow as tf
    from keras import layers as L
    from keras import ops

    class GAN(keras.Model):
        def __init__(self):
            super().__init__()
            self.generator = keras.Sequential(
                [keras.Input((LATENT,)), L.Dense(8 * 8 * 64), L.Reshape((8, 8, 64))]
                + [
                    L.Conv2DTranspose(c, 4, strides=2, padding="same", activation="relu")
                    for c in (64, 32)
                ]
                + [L.Conv2DTranspose(3, 4, strides=2, padding="same", activation="sigmoid")]
            )
            self.discriminator = keras.Sequential(
                [keras.Input((SIZE, SIZE, 3))]
                + [
                    L.Conv2D(c, 4, strides=2, padding="same", activation="relu")
                    for c in (32, 64, 64)
                ]
                + [L.Flatten(), L.Dense(1)]
            )
            self.seed_generator = keras.random.SeedGenerator(1)

        def compile(self):
            super().compile()
            self.d_optimizer = keras.optimizers.Adam(2e-4)
            self.g_optimizer = keras.optimizers.Adam(2e-4)
            self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

        def train_step(self, real):
            real = real[0] if isinstance(real, tuple) else real
            rows = ops.shape(real)[0]
            noise = keras.random.normal((rows, LATENT), seed=self.seed_generator)
            labels = ops.concatenate([ops.ones((rows, 1)), ops.zeros((rows, 1))], axis=0)
            with tf.GradientTape() as tape:
                both = ops.concatenate([self.generator(noise), real], axis=0)
                d_loss = self.loss_fn(labels, self.discriminator(both))
            variables = self.discriminator.trainable_weights
            self.d_optimizer.apply_gradients(zip(tape.gradient(d_loss, variables), variables))
            with tf.GradientTape() as tape:
                fake = self.discriminator(self.generator(noise))
                g_loss = self.loss_fn(ops.zeros((rows, 1)), fake)
            variables = self.generator.trainable_weights
            self.g_optimizer.apply_gradients(zip(tape.gradient(g_loss, variables), variables))
            return {"d_loss": d_loss, "g_loss": g_loss}

    keras.utils.set_random_seed(0)
    model = GAN()
    model.compile()
    return model


def simclr():
    import keras
    import tensorflow as tf
    from keras import layers as L
    from keras import ops

    class Contrastive(keras.Model):
        def __init__(self):
            super().__init__()
            self.augmenter = keras.Sequential([keras.Input((32, 32, 3)), L.GaussianNoise(0.1)])
            self.encoder = keras.Sequential(
                [keras.Input((32, 32, 3))]
                + [L.Conv2D(c, 3, strides=2, padding="same", activation="relu") for c in (32, 64)]
                + [L.GlobalAveragePooling2D(), L.Dense(128, activation="relu"), L.Dense(64)]
            )

        def train_step(self, data):
            x = data[0] if isinstance(data, tuple) else data
            with tf.GradientTape() as tape:
                views = [self.augmenter(x, training=True) for _ in range(2)]
                z = ops.normalize(self.encoder(ops.concatenate(views, axis=0)), axis=1)
                rows = ops.shape(x)[0]
                logits = ops.matmul(z, ops.transpose(z)) / 0.1 - 1e9 * ops.eye(2 * rows)
                pairs = ops.concatenate([ops.arange(rows, 2 * rows), ops.arange(0, rows)], axis=0)
                loss = ops.mean(
                    keras.losses.sparse_categorical_crossentropy(pairs, logits, from_logits=True)
                )
            variables = self.encoder.trainable_weights
            self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return {"loss": loss}

    keras.utils.set_random_seed(0)
    model = Contrastive()
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    return model


def dpsgd():
    import keras
    import tensorflow as tf
    from keras import layers as L
    from keras import ops

    class Private(keras.Sequential):
        """DP-SGD: each row's gradient by `tf.vectorized_map`, clipped, summed, noised."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.noise = keras.random.SeedGenerator(1)

        def train_step(self, data):
            x, y = data
            weights = self.trainable_variables

            def row(pair):
                xi, yi = pair
                with tf.GradientTape() as tape:
                    loss = keras.losses.sparse_categorical_crossentropy(
                        yi[None], self(xi[None], training=True), from_logits=True
                    )[0]
                return tape.gradient(loss, weights), loss

            grads, losses = tf.vectorized_map(row, (x, y))
            squares = [ops.sum(ops.reshape(g, (ops.shape(g)[0], -1)) ** 2, axis=1) for g in grads]
            factors = 1.0 / ops.maximum(ops.sqrt(sum(squares)), 1.0)
            count = ops.cast(ops.shape(x)[0], "float32")
            noisy = []
            for grad, weight in zip(grads, weights):
                total = ops.sum(grad * ops.reshape(factors, [-1] + [1] * len(weight.shape)), 0)
                draw = keras.random.normal(weight.shape, stddev=0.5, seed=self.noise)
                noisy.append((total + draw) / count)
            self.optimizer.apply_gradients(zip(noisy, weights))
            return {"loss": ops.mean(losses)}

    keras.utils.set_random_seed(0)
    model = Private(
        [keras.Input((28, 28, 1))]
        + [L.Conv2D(c, 3, strides=2, padding="same", activation="relu") for c in (16, 32)]
        + [L.Flatten(), L.Dense(10)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def data(program: str, batches: int):
    import numpy as np

    rng = np.random.default_rng(0)
    if program == "dpsgd":
        x = rng.uniform(size=(batches * BATCH, 28, 28, 1)).astype("float32")
        return x, rng.integers(0, 10, size=(batches * BATCH,))
    size = SIZE if program == "dcgan" else 32
    return rng.uniform(size=(batches * BATCH, size, size, 3)).astype("float32"), None


def build(program: str, side: str, devices):
    import tensorflow as tf

    import kmirror

    make = {"dcgan": dcgan, "simclr": simclr, "dpsgd": dpsgd}[program]
    if side == "kmirror":
        return kmirror.wrap(make(), reducer="hierarchical_copy", devices=devices)
    if side == "one_device":
        with tf.device(devices[0]):
            return make()
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.HierarchicalCopyAllReduce()
    )
    with strategy.scope():
        model = make()
        # Keras builds a model under a strategy symbolically, through its call(), which neither
        # model has (kmirror builds them as one device does, from their first step).
        model.built = True
        model.optimizer.build(model.trainable_variables)
        return model


def child(program: str, side: str, devices: int, batches: int) -> None:
    """Trains one side for 2 epochs and prints the median of its steps' peak tensor memory
    (MiB) as JSON."""
    import kmirror

    simulated = kmirror.devices.simulate(devices)
    import keras
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(THREADS_PER_REPLICA * devices)
    model = build(program, side, simulated)
    x, y = data(program, batches)
    peaks = []

    class StepPeaks(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            for device in simulated:
                tf.config.experimental.reset_memory_stats(device)

        def on_train_batch_end(self, batch, logs=None):
            peaks.append(common.tensor_peak_mib(simulated))

    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[StepPeaks()])
    common.print_peak_memory(tensor_peak_mib=statistics.median(peaks))


def peak(program: str, side: str, devices: int, batches: int, runs: int) -> float:
    arguments = ["--child", side, "--program", program]
    arguments += ["--devices", str(devices), "--batches", str(batches)]
    env = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}
    measured = [
        common.measured_in_child(__file__, arguments, timeout=900, env=env)["tensor_peak_mib"]
        for _ in range(runs)
    ]
    return statistics.median(measured)


def _sides(program: str) -> tuple[str, ...]:
    return SIDES + (("one_device",) if program in ONE_DEVICE else ())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--memory-runs", type=int, default=5)
    parser.add_argument("--child", choices=SIDES + ("one_device",))
    parser.add_argument("--program", choices=PROGRAMS, default="dcgan")
    parser.add_argument("--programs", default=",".join(PROGRAMS), help="those measured")
    args = parser.parse_args()
    if args.child:
        return child(args.program, args.child, args.devices, args.batches)
    programs = args.programs.split(",")

    memory = {
        (program, side): peak(program, side, args.devices, args.batches, args.memory_runs)
        for program in programs
        for side in _sides(program)
    }

    import kmirror

    devices = kmirror.devices.simulate(args.devices)
    result = {"replicas": args.devices, "batch": BATCH, "machine": common.machine()}
    for program in programs:
        x, y = data(program, args.batches)
        sides = {side: build(program, side, devices) for side in _sides(program)}
        for model in sides.values():  # warm-up: tracing
            common.seconds_per_step(model, x, y, BATCH)
        medians = common.interleaved(
            {
                s: (lambda m=m, x=x, y=y: common.seconds_per_step(m, x, y, BATCH))
                for s, m in sides.items()
            },
            rounds=args.rounds,
        )
        result[program] = {
            "time": round(medians["kmirror"] / medians["native"], 4),
            "peak_memory": round(memory[program, "kmirror"] / memory[program, "native"], 4),
            "kmirror_ms_per_step": round(1e3 * medians["kmirror"], 2),
            "native_ms_per_step": round(1e3 * medians["native"], 2),
            **{f"{side}_peak_mib": round(memory[program, side], 1) for side in _sides(program)},
        }
        if "one_device" in sides:
            result[program]["time_one_device"] = round(
                medians["kmirror"] / medians["one_device"], 4
            )
            result[program]["one_device_ms_per_step"] = round(1e3 * medians["one_device"], 2)
    print(result)
    common.update_results("own_step", {**common.results().get("own_step", {}), **result})
    print(f"wrote {common.RESULTS}")


if __name__ == "__main__":
    main()
