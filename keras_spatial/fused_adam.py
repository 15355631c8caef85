"""`FusedAdam`: Keras's Adam, with each variable's update compiled into fused loops."""

from __future__ import annotations

import functools

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="keras_spatial")
class FusedAdam(keras.optimizers.Adam):
    """`keras.optimizers.Adam` whose update of each variable runs as compiled, fused loops.

    Keras's Adam updates a variable with about a dozen element-wise TensorFlow kernels
    (subtract, multiply, assign-add for each moment, then square root, add, multiply,
    divide, assign-subtract), each a pass over the variable's memory. On CPUs that is
    memory-bound: for the paper's CosmoFlow (9.4 M parameters, most of them in the dense
    head that every rank of a spatial group holds whole) it took 0.074-0.084 s per step
    on one CPU thread here, against 0.025-0.030 s for this class, which compiles the
    element-wise part of each variable's update with XLA
    (`tf.function(jit_compile=True)`) into fused loops that write the variable and its
    moments in place. Each variable's update is compiled at its first step (a few
    seconds in all, and some 60-70 MiB of peak RSS on the CPU while XLA compiles).
    Everything else is Adam's: the arguments, the scalar step size (computed by the same
    ops as Adam), AMSGrad, weight decay, gradient clipping, EMA, loss scaling, gradient
    accumulation and learning-rate schedules, the slot variables and their order (so a
    saved Adam state loads into FusedAdam and back), `get_config`.

    Results equal Adam's to float32 rounding, not bit for bit: XLA may contract a
    multiply and an add into one fused multiply-add, which rounds once instead of
    twice. Use the same optimizer class in runs you compare bit for bit.

    Sparse gradients (`tf.IndexedSlices`, from embedding lookups) are updated by Adam's
    own code. Needs the TensorFlow backend and a TensorFlow build with XLA (the pip
    packages for Linux, CPU and GPU, have it).

    Args:
        The arguments of `keras.optimizers.Adam`; `name` defaults to "fused_adam".

    Example:
    ```python
    optimizer = strategy.distribute_optimizer(keras_spatial.FusedAdam(1e-3))
    ```
    """

    def __init__(self, *args, name="fused_adam", **kwargs):
        super().__init__(*args, name=name, **kwargs)
        if keras.backend.backend() != "tensorflow":
            raise ValueError(
                "FusedAdam needs the TensorFlow backend (it compiles its update with "
                f"tf.function(jit_compile=True)). Current backend: {keras.backend.backend()!r}"
            )
        # One compiled update per trainable variable (by its index in this optimizer),
        # made at its first update and reused: compiled once, eagerly too.
        self._compiled_updates = {}

    def update_step(self, gradient, variable, learning_rate):
        if isinstance(gradient, tf.IndexedSlices):
            return super().update_step(gradient, variable, learning_rate)
        dtype = variable.dtype
        # The step size exactly as Adam computes it, outside the compiled loop.
        lr = tf.cast(learning_rate, dtype)
        gradient = tf.cast(gradient, dtype)
        local_step = tf.cast(self.iterations + 1, dtype)
        beta_1_power = tf.pow(tf.cast(self.beta_1, dtype), local_step)
        beta_2_power = tf.pow(tf.cast(self.beta_2, dtype), local_step)
        alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)

        index = self._get_variable_index(variable)
        slots = [self._momentums[index], self._velocities[index]]
        if self.amsgrad:
            slots.append(self._velocity_hats[index])
        # Adam multiplies by the Python floats `1 - beta` (rounded once to float32);
        # computing 1 - beta in float32 would change the second moment's rate by 1e-5.
        update = self._compiled_updates.get(index)
        if update is None:
            update = _compile_update([_tf_variable(variable)] + [_tf_variable(slot) for slot in slots])
            self._compiled_updates[index] = update
        update(gradient, alpha, _constant(1 - self.beta_1, dtype), _constant(1 - self.beta_2, dtype),
               _constant(self.epsilon, dtype))


def _constant(value, dtype):
    """`value` as a tensor of `dtype`, a Python number rounded once (as Keras's ops do)."""
    if isinstance(value, (int, float)):
        return tf.convert_to_tensor(value, dtype=dtype)
    return tf.cast(value, dtype)


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def _compile_update(variables):
    """`_fused_update` of `variables` (the variable, then its slots) as one XLA cluster:
    a `tf.function` closing over them, called with (gradient, alpha, 1 - beta_1,
    1 - beta_2, epsilon).

    Closing over the variables, not taking them as arguments: a function shared by
    several variables keeps one trace per variable, keyed by identity, and a later
    variable can reuse a dead one's identity (Python ids are recycled).
    """
    return tf.function(
        functools.partial(_fused_update, *variables[:1], slots=variables[1:]),
        jit_compile=True, autograph=False,
    )


def _fused_update(variable, gradient, alpha, one_minus_beta_1, one_minus_beta_2, epsilon, slots):
    """Adam's element-wise update of one variable, in Adam's order of operations:
    m += (g - m)(1 - beta_1); v += (g^2 - v)(1 - beta_2); with AMSGrad v_hat = max(v_hat, v)
    replaces v below; variable -= (m alpha) / (sqrt(v) + epsilon)."""
    m, v = slots[0], slots[1]
    m_new = m + (gradient - m) * one_minus_beta_1
    v_new = v + (tf.square(gradient) - v) * one_minus_beta_2
    m.assign(m_new)
    v.assign(v_new)
    if len(slots) == 3:
        v_new = tf.maximum(slots[2], v_new)
        slots[2].assign(v_new)
    variable.assign_sub((m_new * alpha) / (tf.sqrt(v_new) + epsilon))
