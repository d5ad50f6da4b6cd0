"""Keras 3 model builders: ResNet-50 v1.5 for benchmarks, a small ResNet for demos.

Layers take the Caffe names of the original ResNet release (He et al. 2015):
``conv1``/``bn_conv1`` for the stem, ``res{stage}{block}_branch2{a,b,c}`` for the
residual convolutions, ``res{stage}{block}_branch1`` for the projection
shortcut, ``bn...`` for each convolution's batch norm, ``fc{num_classes}`` for
the classifier. Variable paths are therefore ``"bn2a_branch2c/gamma"``,
``"fc1000/bias"`` and so on: every batch-norm path contains ``"bn"`` and only
the classifier has a bias, so an optimizer can exclude both by pattern.
"""

from __future__ import annotations

import functools
import numbers
import string
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hvrep.errors import ConfigError

if TYPE_CHECKING:
    import keras

DATA_FORMATS = ("channels_last", "channels_first")

# ResNet-50: bottlenecks per stage and their inner widths (outputs are 4× wider).
_RESNET50_BLOCKS = (3, 4, 6, 3)
_RESNET50_WIDTHS = (64, 128, 256, 512)
_EXPANSION = 4

# Batch-norm settings of the MLPerf / NVIDIA ResNet-50 v1.5 reference
# (PyTorch's defaults: its momentum 0.1 is Keras' 0.9).
_BN_MOMENTUM = 0.9
_BN_EPSILON = 1e-5


def resnet50(
    num_classes: int = 1000,
    input_shape: Sequence[int | None] = (224, 224, 3),
    data_format: str = "channels_last",
    zero_init_residual: bool = True,
    name: str = "resnet50",
) -> keras.Model:
    """ResNet-50 v1.5, the NVIDIA / MLPerf variant.

    v1.5 differs from the paper's v1 in one place: a downsampling bottleneck
    strides its 3×3 convolution, not its first 1×1 (more accurate, a little
    slower). Convolutions have no bias; each is followed by batch norm. At
    1000 classes the model has 25,557,032 trainable parameters in 161 tensors.

    Args:
        num_classes: Width of the classifier, >= 1.
        input_shape: One image: (H, W, 3) for channels_last, (3, H, W) for
            channels_first. H and W may be None.
        data_format: "channels_last" (NHWC) or "channels_first" (NCHW, faster
            on GPUs without layout conversion).
        zero_init_residual: Start the last batch-norm gamma of every residual
            block at 0, so each block starts as the identity (Goyal et al.
            2017, "Accurate, Large Minibatch SGD").
        name: The model's name.

    Returns:
        A functional ``keras.Model`` mapping images (batch, *input_shape) to
        logits (batch, num_classes), float32 under the default dtype policy.

    Raises:
        ConfigError: An argument is out of range; the message names it.
    """
    _check_common(num_classes, input_shape, data_format, rgb=True)
    return _build(
        num_classes=num_classes,
        input_shape=tuple(None if d is None else int(d) for d in input_shape),
        data_format=data_format,
        zero_init_residual=zero_init_residual,
        name=name,
        imagenet_stem=True,
        stem_width=64,
        widths=_RESNET50_WIDTHS,
        blocks=_RESNET50_BLOCKS,
        bottleneck=True,
    )


def small_resnet(
    num_classes: int = 10,
    input_shape: Sequence[int | None] = (32, 32, 3),
    data_format: str = "channels_last",
    width: int = 16,
    blocks: Sequence[int] = (1, 1, 1),
    zero_init_residual: bool = True,
    name: str = "small_resnet",
) -> keras.Model:
    """A CIFAR-style ResNet of basic blocks for demos on small images.

    He et al. 2015 (section 4.2): a 3×3 stem of ``width`` channels, then one
    stage per entry of ``blocks``, stage i with ``width * 2**i`` channels and
    stride 2 from the second stage on. The defaults give ResNet-8 (about 78k
    parameters at 10 classes), which trains on a CPU in seconds on 8×8 digits
    or 32×32 images. Names and zero-initialised residual gammas follow
    ``resnet50``.

    Args:
        num_classes: Width of the classifier, >= 1.
        input_shape: One image: (H, W, C) for channels_last, (C, H, W) for
            channels_first. Any number of channels C >= 1; H and W may be None.
        data_format: "channels_last" or "channels_first".
        width: Channels of the stem and the first stage, >= 1.
        blocks: Basic blocks per stage, at least one stage, each 1 to 26
            (one letter per block in the names).
        zero_init_residual: As in ``resnet50``.
        name: The model's name.

    Returns:
        A functional ``keras.Model`` mapping (batch, *input_shape) to logits
        (batch, num_classes).

    Raises:
        ConfigError: An argument is out of range; the message names it.
    """
    _check_common(num_classes, input_shape, data_format, rgb=False)
    if not _is_int(width, minimum=1):
        raise ConfigError(f"width must be an int >= 1, got {width!r}; 16 is the CIFAR ResNet's.")
    blocks = tuple(blocks) if isinstance(blocks, Sequence) and not isinstance(blocks, str) else blocks
    if not isinstance(blocks, tuple) or not blocks or any(not _is_int(b, minimum=1) or b > 26 for b in blocks):
        raise ConfigError(
            f"blocks must be a non-empty tuple of ints in [1, 26] (basic blocks per stage), got {blocks!r}; "
            "e.g. (1, 1, 1) or (3, 3, 3)."
        )
    return _build(
        num_classes=num_classes,
        input_shape=tuple(None if d is None else int(d) for d in input_shape),
        data_format=data_format,
        zero_init_residual=zero_init_residual,
        name=name,
        imagenet_stem=False,
        stem_width=width,
        widths=tuple(int(width) * 2**i for i in range(len(blocks))),
        blocks=tuple(int(b) for b in blocks),
        bottleneck=False,
    )


def with_fused_batch_norm(model: keras.Model) -> keras.Model:
    """A copy of ``model`` with ``hvrep.layers.FusedBatchNormalization`` for each ``keras.layers.BatchNormalization``.

    For models built elsewhere, e.g. ``keras.applications.ResNet50``: the copy
    has the same layers, configuration and weights (copied), and computes the
    same function; it trains faster (see ``FusedBatchNormalization``). Build it
    inside ``Replicator.scope()`` like any model, so its variables start equal
    on every replica.

    Args:
        model: A functional or Sequential Keras model (built).

    Returns:
        The new model; ``model`` is left as it was.

    Raises:
        ConfigError: ``model`` is a subclassed model, which Keras cannot clone.
    """
    import keras

    from hvrep.layers import FusedBatchNormalization

    def clone(layer: Any) -> Any:
        kind = FusedBatchNormalization if type(layer) is keras.layers.BatchNormalization else type(layer)
        return kind.from_config(layer.get_config())

    try:
        fused = keras.models.clone_model(model, clone_function=clone)
    except ValueError as e:  # Keras' answer for subclassed models
        raise ConfigError(
            f"with_fused_batch_norm needs a functional or Sequential model, got a {type(model).__name__}: {e} "
            "Fix: build its batch norms as hvrep.layers.FusedBatchNormalization directly."
        ) from e
    fused.set_weights(model.get_weights())
    return fused


def resnet50_variable_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """(path, shape) of each of ResNet-50's 161 trainable variables, in model order.

    At 1000 classes, channels_last; e.g. ``("conv1/kernel", (7, 7, 3, 64))``
    first and ``("fc1000/bias", (1000,))`` last. The model is built once per
    process (about a second on a CPU) and the answer cached.
    """
    return list(_resnet50_variable_shapes())


@functools.cache
def _resnet50_variable_shapes() -> tuple[tuple[str, tuple[int, ...]], ...]:
    # Shapes do not depend on the image size; a small one builds faster.
    model = resnet50(input_shape=(32, 32, 3))
    return tuple((v.path, tuple(int(d) for d in v.shape)) for v in model.trainable_variables)


def _is_int(value: Any, *, minimum: int) -> bool:
    """True for an integer (NumPy's too, not bool) >= minimum."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def _check_common(num_classes: Any, input_shape: Any, data_format: Any, *, rgb: bool) -> None:
    if data_format not in DATA_FORMATS:
        raise ConfigError(f"data_format must be one of {DATA_FORMATS}, got {data_format!r}.")
    if not _is_int(num_classes, minimum=1):
        raise ConfigError(f"num_classes must be an int >= 1, got {num_classes!r}.")
    layout, example = ("(H, W, C)", (224, 224, 3)) if data_format == "channels_last" else ("(C, H, W)", (3, 224, 224))
    if (
        not isinstance(input_shape, Sequence)
        or isinstance(input_shape, str)
        or len(input_shape) != 3
        or any(d is not None and not _is_int(d, minimum=1) for d in input_shape)
    ):
        rank4 = isinstance(input_shape, Sequence) and len(input_shape) == 4
        fix = "drop the batch dimension" if rank4 else f"e.g. {example}"
        raise ConfigError(
            f"input_shape must be one image's shape {layout} for data_format={data_format!r}, positive ints "
            f"(H and W may be None), got {input_shape!r}; {fix}."
        )
    channels = input_shape[-1] if data_format == "channels_last" else input_shape[0]
    if channels is None:
        raise ConfigError(
            f"input_shape's channel dimension must be known, got {input_shape!r} for data_format={data_format!r}."
        )
    if rgb and channels != 3:
        other, other_channels = (
            ("channels_first", input_shape[0]) if data_format == "channels_last" else ("channels_last", input_shape[-1])
        )
        fix = f"pass data_format={other!r}" if other_channels == 3 else "give 3 (RGB) channels"
        raise ConfigError(
            f"input_shape must be {layout} with 3 (RGB) channels for data_format={data_format!r}, got "
            f"{input_shape!r}; {fix}."
        )


def _build(
    *,
    num_classes: int,
    input_shape: tuple[int | None, ...],
    data_format: str,
    zero_init_residual: bool,
    name: str,
    imagenet_stem: bool,
    stem_width: int,
    widths: tuple[int, ...],
    blocks: tuple[int, ...],
    bottleneck: bool,
) -> keras.Model:
    import keras

    from hvrep.layers import FusedBatchNormalization, SubsamplingConv2D

    bn_axis = -1 if data_format == "channels_last" else 1
    layers = keras.layers

    def conv(x: Any, filters: int, kernel: int, strides: int, layer_name: str) -> Any:
        # A strided convolution pads explicitly and symmetrically, (k - 1) // 2
        # on every side, as PyTorch and the MLPerf TF reference do: Keras'
        # "same" pads an even-sized input only at the bottom and right,
        # shifting every window by one pixel against the reference weights.
        padding = "same"
        if strides > 1 and kernel > 1:
            x = layers.ZeroPadding2D((kernel - 1) // 2, data_format=data_format, name=f"{layer_name}_pad")(x)
            padding = "valid"
        # A strided 1x1 convolution (a projection shortcut) of a narrow input crashes TensorFlow's oneDNN
        # backward kernel at odd batch sizes: SubsamplingConv2D computes it another way (see its docstring).
        kind = SubsamplingConv2D if kernel == 1 and strides > 1 else layers.Conv2D
        return kind(
            filters,
            kernel,
            strides=strides,
            padding=padding,
            use_bias=False,
            data_format=data_format,
            # He et al. 2015 in fan-out mode, as torchvision and the NVIDIA
            # reference initialise ResNet (kaiming_normal_, mode="fan_out").
            kernel_initializer=keras.initializers.VarianceScaling(2.0, "fan_out", "untruncated_normal"),
            name=layer_name,
        )(x)

    def bn(x: Any, layer_name: str, zero_gamma: bool = False) -> Any:
        # TensorFlow's fused kernel when training channels_last: Keras 3's own
        # layer made a ResNet-50 step about 15% slower (FusedBatchNormalization says where measured).
        return FusedBatchNormalization(
            axis=bn_axis,
            momentum=_BN_MOMENTUM,
            epsilon=_BN_EPSILON,
            gamma_initializer="zeros" if zero_gamma else "ones",
            name=layer_name,
        )(x)

    def block(x: Any, width: int, strides: int, project: bool, prefix: str) -> Any:
        """One residual block; ``prefix`` is e.g. "2a" (stage 2, first block)."""
        if bottleneck:
            # v1.5: the stride sits on the 3×3 (branch2b), not the first 1×1.
            specs = [(width, 1, 1, "2a"), (width, 3, strides, "2b"), (width * _EXPANSION, 1, 1, "2c")]
        else:
            specs = [(width, 3, strides, "2a"), (width, 3, 1, "2b")]
        out_width = specs[-1][0]
        shortcut = x
        if project:
            shortcut = conv(x, out_width, 1, strides, f"res{prefix}_branch1")
            shortcut = bn(shortcut, f"bn{prefix}_branch1")
        y = x
        for i, (filters, kernel, stride, branch) in enumerate(specs):
            y = conv(y, filters, kernel, stride, f"res{prefix}_branch{branch}")
            last = i == len(specs) - 1
            y = bn(y, f"bn{prefix}_branch{branch}", zero_gamma=last and zero_init_residual)
            if not last:
                y = layers.ReLU(name=f"res{prefix}_branch{branch}_relu")(y)
        y = layers.Add(name=f"res{prefix}")([shortcut, y])
        return layers.ReLU(name=f"res{prefix}_relu")(y)

    inputs = keras.Input(shape=input_shape, name="images")
    if imagenet_stem:
        x = conv(inputs, stem_width, 7, 2, "conv1")
        x = layers.ReLU(name="conv1_relu")(bn(x, "bn_conv1"))
        # Zero padding equals PyTorch's -inf here: the input is after a ReLU.
        x = layers.ZeroPadding2D(1, data_format=data_format, name="pool1_pad")(x)
        x = layers.MaxPooling2D(3, strides=2, data_format=data_format, name="pool1")(x)
    else:
        x = conv(inputs, stem_width, 3, 1, "conv1")
        x = layers.ReLU(name="conv1_relu")(bn(x, "bn_conv1"))
    in_width = stem_width
    for s, (width, n) in enumerate(zip(widths, blocks, strict=True)):
        stage = s + 2  # Caffe numbering: the stem is stage 1
        strides = 1 if s == 0 else 2
        out_width = width * _EXPANSION if bottleneck else width
        for b in range(n):
            project = b == 0 and (strides != 1 or in_width != out_width)
            x = block(x, width, strides if b == 0 else 1, project, f"{stage}{string.ascii_lowercase[b]}")
            in_width = out_width
    x = layers.GlobalAveragePooling2D(data_format=data_format, name="avg_pool")(x)
    # float32 logits even under a mixed-precision policy: softmax and the loss need the range.
    logits = layers.Dense(num_classes, name=f"fc{num_classes}", dtype="float32")(x)
    return keras.Model(inputs, logits, name=name)
