"""hvrep.models: ResNet-50 v1.5 against its published architecture, and the small demo ResNet."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvrep import models
from hvrep.errors import ConfigError

# Published figures for ResNet-50 (v1 and v1.5 have the same weights; v1.5 only
# moves a stride). Trainable parameters: torchvision's resnet50 and NVIDIA's
# DeepLearningExamples v1.5 both count 25,557,032; Keras Applications' ResNet50
# reports 25,583,592 trainable because its convolutions carry biases (26,560 of
# them, one per conv output channel), and 53,120 non-trainable (moving mean and
# variance over the same 26,560 batch-norm channels).
RESNET50_TRAINABLE_PARAMS = 25_557_032
RESNET50_MOVING_STATS = 53_120
# 1 stem conv + 16 blocks × 3 convs + 4 projection convs = 53 convs, each with a
# batch norm (gamma, beta), then the dense kernel and bias: 53 × 3 + 2.
RESNET50_CONVS = 53
RESNET50_TRAINABLE_TENSORS = 161
RESNET50_FEATURES = 2048  # width of the pooled features feeding the classifier
# Block names of the Caffe release: stages 2-5 with 3, 4, 6, 3 bottlenecks.
RESNET50_BLOCKS = [
    f"{stage}{letter}" for stage, n in zip((2, 3, 4, 5), (3, 4, 6, 3), strict=True) for letter in "abcdef"[:n]
]


def _count(variables: list) -> int:
    return sum(math.prod(v.shape) for v in variables)


@pytest.fixture(scope="module")
def r50() -> keras.Model:
    # Built once: ResNet-50 takes a second or two to build on CPU.
    return models.resnet50()


@pytest.fixture(scope="module")
def r50_plain_10() -> keras.Model:
    """10 classes, no zero-init: the other side of both defaults."""
    return models.resnet50(num_classes=10, input_shape=(64, 64, 3), zero_init_residual=False)


def test_resnet50_has_the_published_parameter_and_tensor_counts(r50):
    assert _count(r50.trainable_variables) == RESNET50_TRAINABLE_PARAMS
    assert len(r50.trainable_variables) == RESNET50_TRAINABLE_TENSORS
    assert _count(r50.non_trainable_variables) == RESNET50_MOVING_STATS
    convs = [layer for layer in r50.layers if isinstance(layer, keras.layers.Conv2D)]
    assert len(convs) == RESNET50_CONVS
    assert all(not conv.use_bias for conv in convs)


def test_num_classes_changes_only_the_classifier(r50_plain_10):
    k = 10
    expected = RESNET50_TRAINABLE_PARAMS + RESNET50_FEATURES * (k - 1000) + (k - 1000)
    assert _count(r50_plain_10.trainable_variables) == expected
    assert len(r50_plain_10.trainable_variables) == RESNET50_TRAINABLE_TENSORS


def test_stride_is_on_the_3x3_conv_v1_5(r50):
    for stage in (2, 3, 4, 5):
        stride = 1 if stage == 2 else 2
        assert r50.get_layer(f"res{stage}a_branch2a").strides == (1, 1)
        assert r50.get_layer(f"res{stage}a_branch2b").kernel_size == (3, 3)
        assert r50.get_layer(f"res{stage}a_branch2b").strides == (stride, stride)
        assert r50.get_layer(f"res{stage}a_branch2c").strides == (1, 1)
        assert r50.get_layer(f"res{stage}a_branch1").strides == (stride, stride)
    # Only the first block of a stage has a projection shortcut.
    projections = sorted(
        layer.name for layer in r50.layers if layer.name.startswith("res") and layer.name.endswith("branch1")
    )
    assert projections == ["res2a_branch1", "res3a_branch1", "res4a_branch1", "res5a_branch1"]


def test_feature_map_sizes_at_224(r50):
    assert tuple(r50.get_layer("pool1").output.shape) == (None, 56, 56, 64)
    for stage, side in zip((2, 3, 4, 5), (56, 28, 14, 7), strict=True):
        last = [b for b in RESNET50_BLOCKS if b.startswith(str(stage))][-1]
        assert tuple(r50.get_layer(f"res{last}_relu").output.shape) == (None, side, side, 64 * 2**stage)


def test_batch_norm_settings(r50):
    bns = [layer for layer in r50.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(bns) == RESNET50_CONVS
    assert all(bn.momentum == 0.9 and bn.epsilon == 1e-5 for bn in bns)


def test_zero_init_residual_zeroes_the_last_gamma_of_each_block(r50, r50_plain_10):
    last = {f"bn{block}_branch2c" for block in RESNET50_BLOCKS}
    bns = [layer for layer in r50.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert {bn.name for bn in bns} >= last
    for bn in bns:
        expected = 0.0 if bn.name in last else 1.0
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(bn.gamma), expected, err_msg=bn.name)
    for bn in r50_plain_10.layers:
        if isinstance(bn, keras.layers.BatchNormalization):
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(bn.gamma), 1.0, err_msg=bn.name)


def test_paths_let_an_optimizer_exclude_batch_norm_and_bias(r50):
    bn_paths = {
        v.path for layer in r50.layers if isinstance(layer, keras.layers.BatchNormalization) for v in layer.variables
    }
    assert bn_paths == {v.path for v in r50.variables if "bn" in v.path}
    assert [v.path for v in r50.trainable_variables if v.path.endswith("bias")] == ["fc1000/bias"]
    paths = [v.path for v in r50.variables]
    assert len(paths) == len(set(paths))
    assert paths[0] == "conv1/kernel"


def test_variable_shapes_list(r50):
    shapes = models.resnet50_variable_shapes()
    assert shapes == [(v.path, tuple(v.shape)) for v in r50.trainable_variables]
    assert shapes[0] == ("conv1/kernel", (7, 7, 3, 64))
    assert shapes[-2:] == [("fc1000/kernel", (2048, 1000)), ("fc1000/bias", (1000,))]
    assert sum(math.prod(shape) for _, shape in shapes) == RESNET50_TRAINABLE_PARAMS
    shapes.clear()  # a copy: the cached answer is unaffected
    assert len(models.resnet50_variable_shapes()) == RESNET50_TRAINABLE_TENSORS


def test_output_shape_channels_last(r50_plain_10):
    logits = r50_plain_10(np.zeros((2, 64, 64, 3), np.float32), training=False)
    assert tuple(logits.shape) == (2, 10)


def test_channels_first(r50_plain_10):
    model = models.resnet50(
        num_classes=10, input_shape=(3, 64, 64), data_format="channels_first", zero_init_residual=False
    )
    # Same variables, same shapes: NCHW changes the activations' layout only.
    assert [(v.path, tuple(v.shape)) for v in model.variables] == [
        (v.path, tuple(v.shape)) for v in r50_plain_10.variables
    ]
    bns = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert all(bn.axis == 1 for bn in bns)
    assert tuple(model.get_layer("res5c_relu").output.shape) == (None, 2048, 2, 2)
    try:
        logits = model(np.zeros((2, 3, 64, 64), np.float32), training=False)
    except tf.errors.UnimplementedError:
        # TensorFlow's own CPU Conv2D is NHWC-only; NCHW runs on CPU only
        # through oneDNN (on by default on x86, off with TF_ENABLE_ONEDNN_OPTS=0
        # or on other CPUs). The structure is checked above either way.
        pytest.skip("this TensorFlow build cannot run NCHW convolutions on CPU")
    assert tuple(logits.shape) == (2, 10)


def test_small_resnet_trains_one_step_on_digit_sized_images():
    keras.utils.set_random_seed(0)
    model = models.small_resnet(num_classes=10, input_shape=(8, 8, 1))
    x = np.random.default_rng(0).random((16, 8, 8, 1), dtype=np.float32)
    y = np.arange(16) % 10
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    before = [keras.ops.convert_to_numpy(v).copy() for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss = loss_fn(y, logits)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)
    assert tuple(logits.shape) == (16, 10)
    assert np.isfinite(float(loss))
    after = [keras.ops.convert_to_numpy(v) for v in model.trainable_variables]
    assert all(np.isfinite(a).all() for a in after)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before, strict=True))
    assert np.isfinite(keras.ops.convert_to_numpy(model(x, training=False))).all()


def test_small_resnet_structure():
    model = models.small_resnet(blocks=(2, 1), width=8, zero_init_residual=False)
    names = {layer.name for layer in model.layers}
    assert {"conv1", "bn_conv1", "res2a_branch2a", "res2b_branch2b", "res3a_branch1", "fc10"} <= names
    assert "res2a_branch1" not in names  # same width and stride: identity shortcut
    assert tuple(model.get_layer("avg_pool").output.shape) == (None, 16)
    gammas = [v for v in model.trainable_variables if v.path.endswith("gamma")]
    assert all((keras.ops.convert_to_numpy(g) == 1.0).all() for g in gammas)
    zeroed = models.small_resnet()
    assert (keras.ops.convert_to_numpy(zeroed.get_layer("bn2a_branch2b").gamma) == 0.0).all()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"data_format": "NHWC"}, "data_format"),
        ({"num_classes": 0}, "num_classes"),
        ({"num_classes": 2.5}, "num_classes"),
        ({"input_shape": (224, 224)}, "input_shape"),
        ({"input_shape": (1, 224, 224, 3)}, "input_shape"),
        ({"input_shape": (0, 224, 3)}, "input_shape"),
        ({"input_shape": (3, 224, 224)}, "input_shape"),
        ({"input_shape": (224, 224, 1)}, "input_shape"),
        ({"input_shape": (224, 224, 3), "data_format": "channels_first"}, "input_shape"),
    ],
)
def test_resnet50_rejects_bad_arguments(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        models.resnet50(**kwargs)
    message = str(err.value)
    assert needle in message
    assert repr(kwargs[needle]) in message


def test_resnet50_says_which_data_format_fits():
    with pytest.raises(ConfigError, match="pass data_format='channels_first'"):
        models.resnet50(input_shape=(3, 224, 224))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"width": 0}, "width"),
        ({"blocks": ()}, "blocks"),
        ({"blocks": (1, 0)}, "blocks"),
        ({"num_classes": -1}, "num_classes"),
        ({"input_shape": (32, 32, None)}, "input_shape"),
    ],
)
def test_small_resnet_rejects_bad_arguments(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        models.small_resnet(**kwargs)
    assert needle in str(err.value)
    assert repr(kwargs[needle]) in str(err.value)
