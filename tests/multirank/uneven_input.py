"""A user's replica-API loop whose input_fn yields 5 batches on rank 0 and 6 on rank 1 (run by
test_dead_and_stopped_ranks.py under a launcher). Without hvrep's watchdog it hangs forever: rank 0 reduces
while rank 1 runs a sixth step, and Horovod waits for both to issue the same collective."""

import keras
import tensorflow as tf

import hvrep

repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(timeout_s=600))
with repl.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)


def input_fn(ctx: hvrep.InputContext) -> tf.data.Dataset:
    batches = 5 + ctx.replica_id  # uneven: the bug the watchdog turns into an error
    x = tf.random.stateless_normal((batches * 8, 4), seed=(1, ctx.replica_id))
    return tf.data.Dataset.from_tensor_slices((x, tf.zeros(batches * 8, tf.int32))).batch(8)


def step_fn(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
    grads = hvrep.all_reduce(tape.gradient(loss, model.trainable_variables), "mean")
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return {"loss": loss}


for x, y in repl.distribute_dataset(input_fn, global_batch_size=16):
    out = repl.run(step_fn, args=(x, y))
print("loss", repl.reduce(out["loss"], "mean"), flush=True)
