"""What hvrep's avoidance of the oneDNN strided-1x1 crash costs, on shapes that do not crash (issue 48).

    python benchmarks/strided_1x1.py --threads 2 --repeats 30 --out results/strided_1x1.jsonl

``hvrep.layers.SubsamplingConv2D`` computes a strided 1x1 convolution of fewer than 16 channels as a strided
slice, then a stride-1 convolution; Keras' ``Conv2D`` runs TensorFlow's strided convolution, whose oneDNN
backward-filter kernel crashes at odd batch sizes (docs/troubleshooting.md, "Known issues"). At even batch
sizes both run, and this times them round-robin in one process (round i of both ran seconds apart, under
the same load; ratios are per round):

* ``shortcut``: the layer alone, forward and backward (input and kernel gradients), per batch and width;
* ``demo step``: one whole ``hvrep train`` step (``hvrep.train.steps.Runner``: forward, backward, update) of
  the demo model (``small_resnet``), with its projection shortcuts as each kind.

Prints the median of each and the ratio SubsamplingConv2D / Conv2D (above 1: the avoidance is slower) with
the p10-p90 spread of the per-round ratios; appends one JSON line per case to ``--out``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import append_jsonl, environment, fmt_ratio, percentiles, ratio, run_id, timing_parser


def main(argv: list[str] | None = None) -> None:
    p = timing_parser(__doc__, "results/strided_1x1.jsonl", "case", "inputs", quick_warmup=1, quick_repeats=3)
    p.add_argument("--threads", type=int, default=2, help="TensorFlow's intra- and inter-op threads (default 2)")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128], help="even batch sizes (default 32 64 128)")
    p.add_argument("--widths", type=int, nargs="+", default=[8, 12], help="input channels, < 16 (default 8 12)")
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.repeats = args._quick
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    import hvrep
    from hvrep.layers import SubsamplingConv2D
    from hvrep.models import small_resnet
    from hvrep.train.steps import Runner

    cases: dict[str, dict[str, object]] = {}  # case -> {"Conv2D": fn, "SubsamplingConv2D": fn}
    for width in args.widths:
        for batch in args.batches:
            x = tf.random.stateless_normal([batch, 32, 32, width], seed=[args.seed, 0])
            fns = {}
            for kind in (keras.layers.Conv2D, SubsamplingConv2D):
                layer = kind(2 * width, 1, strides=2, use_bias=False)
                layer.build(x.shape)

                @tf.function
                def step(x, layer=layer):
                    with tf.GradientTape() as tape:
                        tape.watch(x)
                        y = layer(x)
                        loss = tf.reduce_sum(y * y)
                    gx, gw = tape.gradient(loss, [x, layer.kernel])
                    return tf.reduce_sum(gx) + tf.reduce_sum(gw)

                fns[kind.__name__] = lambda step=step, x=x: float(step(x))
            cases[f"shortcut {width}->{2 * width} ch, batch {batch}"] = fns

    repl = hvrep.Replicator("local")
    for width in args.widths:
        batch = max(args.batches) // 2 * 2
        fns = {}
        for kind in ("Conv2D", "SubsamplingConv2D"):
            with repl.scope():
                model = small_resnet(width=width, input_shape=(32, 32, 3))
                if kind == "Conv2D":
                    def plain(layer):
                        cls = keras.layers.Conv2D if isinstance(layer, SubsamplingConv2D) else type(layer)
                        return cls.from_config(layer.get_config())
                    model = keras.models.clone_model(model, clone_function=plain)
                optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
                optimizer.build(model.trainable_variables)
            runner = Runner(repl, model, optimizer, num_classes=10, label_smoothing=0.0, fp16=False, jit_compile=False)
            x = tf.random.stateless_uniform([batch, 32, 32, 3], seed=[args.seed, 1])
            y = tf.random.stateless_uniform([batch], seed=[args.seed, 2], maxval=10, dtype=tf.int32)
            xs, ys = next(iter(repl.distribute_dataset(lambda ctx, x=x, y=y: tf.data.Dataset.from_tensors((x, y)))))
            fns[kind] = lambda runner=runner, xs=xs, ys=ys: float(repl.reduce(runner.train(xs, ys)[0], "mean"))
        cases[f"demo step, width {width}, batch {batch}"] = fns

    times: dict[str, dict[str, list[float]]] = {c: {k: [] for k in fns} for c, fns in cases.items()}
    for fns in cases.values():
        for fn in fns.values():
            for _ in range(args.warmup):
                fn()
    for r in range(args.repeats):
        for case, fns in cases.items():
            kinds = list(fns) if r % 2 == 0 else list(fns)[::-1]  # alternate which runs first
            for kind in kinds:
                t0 = time.perf_counter()
                fns[kind]()
                times[case][kind].append((time.perf_counter() - t0) * 1e3)
    rid, env = run_id(), environment()
    records = []
    print(f"{'case':44s} {'Conv2D ms':>10s} {'Subsampling ms':>15s}  ratio [p10-p90 per round]")
    for case, by_kind in times.items():
        a, b = by_kind["SubsamplingConv2D"], by_kind["Conv2D"]
        rr = ratio(a, b)
        print(f"{case:44s} {percentiles(b)['median_ms']:10.2f} {percentiles(a)['median_ms']:15.2f}  {fmt_ratio(rr)}")
        records.append({"run_id": rid, "case": case, "threads": args.threads, "repeats": args.repeats,
                        "conv2d": percentiles(b), "subsampling": percentiles(a), "ratio": rr, "env": env})
    append_jsonl(args.out, records)


if __name__ == "__main__":
    main()
