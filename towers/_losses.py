"""Several losses in one tower, each with its optimizer and its variables.

`model_fn` returns one scalar loss, or a dict of them (``{"d": d_loss, "g":
g_loss}``: a GAN's two networks, a multi-task model's heads), built in one
forward pass per tower. Then `opt` is a dict of optimizers under the same
keys, and `var_list` a dict naming each loss's variables, resolved once
tower 0 has made them: a name prefix, a list of variables, or a callable
returning one. Each key's gradients are computed, averaged and applied on
their own, as a single device's ``opt_k.minimize(loss_k, var_list=vars_k)``.

Inside, every loss has a key; the one loss of a `model_fn` that returns a
loss has the key `SINGLE`, and `unwrap` gives back what the caller passed.
"""

from typing import Any, Dict, Hashable, List, Mapping, Optional, Tuple

import tensorflow.compat.v1 as tf

# The key of the loss of a model_fn that returns one loss.
SINGLE = None

Key = Optional[Hashable]


def optimizers(opt: object) -> Dict[Key, tf.train.Optimizer]:
  """Returns {key: optimizer} for `opt`, one optimizer or a dict of them.

  Raises:
    TypeError: for something that is not a ``tf.compat.v1`` optimizer.
    ValueError: for an empty dict.
  """
  if isinstance(opt, Mapping):
    if not opt:
      raise ValueError("opt is an empty dict; pass an optimizer, or a dict "
                       "{key: optimizer} with a key for each of model_fn's "
                       "losses")
    for key, each in opt.items():
      _check_optimizer(each, "opt[%r]" % (key,))
    return dict(opt)
  _check_optimizer(opt, "opt")
  return {SINGLE: opt}


def _check_optimizer(opt: object, what: str) -> None:
  if not hasattr(opt, "compute_gradients") or not hasattr(
      opt, "apply_gradients"):
    raise TypeError(
        "expected %s to be a tf.compat.v1.train.Optimizer (it needs "
        "compute_gradients and apply_gradients), got %r; Keras optimizers "
        "do not work in graph mode towers, use e.g. "
        "tf.compat.v1.train.MomentumOptimizer" % (what, opt))


def unwrap(values: Mapping[Any, Any]) -> Any:
  """What the caller sees: the single loss's value, else the dict."""
  if list(values) == [SINGLE]:
    return values[SINGLE]
  return dict(values)


def named(key: Key) -> str:
  """`key` for a message: nothing for the single loss."""
  return "" if key is SINGLE else " %r" % (key,)


def check_result(result: object, scope: str,
                 keys: List[Key]) -> Tuple[Dict[Key, tf.Tensor], object]:
  """Returns ``({key: loss}, outputs)`` from what `model_fn` returned.

  `result` is a loss, a dict of losses, or either with outputs as a pair;
  its losses must have `keys`, the optimizers' keys.

  Raises:
    TypeError, ValueError: naming the tower, the key and the fix.
  """
  tower = scope.rstrip("/")
  outputs = None
  if isinstance(result, (tuple, list)):
    if len(result) != 2:
      raise ValueError(
          "model_fn returned a %s of %d items in %s; expected the loss (or a "
          "dict of losses) or a pair (loss, outputs)"
          % (type(result).__name__, len(result), tower))
    result, outputs = result
  if keys == [SINGLE]:
    if isinstance(result, Mapping):
      raise ValueError(
          "model_fn returned the losses %s in %s, but opt is one optimizer: "
          "pass opt as a dict {key: optimizer} with the same keys, and "
          "var_list as a dict naming each loss's variables"
          % (", ".join(map(repr, result)), tower))
    return {SINGLE: _check_loss(result, tower, SINGLE)}, outputs
  if not isinstance(result, Mapping):
    raise ValueError(
        "opt is a dict of optimizers for the losses %s, but model_fn returned "
        "%r in %s; return a dict of scalar losses with the same keys"
        % (", ".join(map(repr, keys)), result, tower))
  for key in result:
    if key not in keys:
      raise ValueError(
          "model_fn returned the loss %r in %s, which opt has no optimizer "
          "for; add opt[%r], or drop the loss" % (key, tower, key))
  for key in keys:
    if key not in result:
      raise ValueError(
          "opt has an optimizer for %r, but model_fn returned no loss %r in "
          "%s; return it, or drop opt[%r]" % (key, key, tower, key))
  return {key: _check_loss(result[key], tower, key) for key in keys}, outputs


def _check_loss(loss: Any, tower: str, key: Key) -> tf.Tensor:
  """`loss` as a scalar float tensor; an unknown rank is checked at run
  time."""
  of = "" if key is SINGLE else " for the loss %r" % (key,)
  if loss is None:
    raise ValueError("model_fn returned no loss (None)%s in %s; it must "
                     "return the tower's scalar loss, or (loss, outputs)"
                     % (of, tower))
  if isinstance(loss, tf.Variable):
    loss = tf.convert_to_tensor(loss)
  if not isinstance(loss, tf.Tensor):
    raise TypeError(
        "expected model_fn to return the loss as a scalar float tf.Tensor%s "
        "in %s, got %s %r; build the loss from the tower's tensors"
        % (of, tower, type(loss).__name__, loss))
  if not loss.dtype.is_floating:
    raise TypeError(
        "expected model_fn to return a float loss, got %s%s in %s; cast it "
        "with tf.cast(loss, tf.float32)" % (loss.dtype.name, of, tower))
  if loss.shape.rank is None:
    # Only known at run time: check it then, with the same hint.
    check = tf.debugging.assert_rank(
        loss, 0, message="expected model_fn to return a scalar loss%s in %s; "
        "did you forget tf.reduce_mean?" % (of, tower))
    with tf.control_dependencies([check]):
      loss = tf.identity(loss)
    loss.set_shape([])
  elif loss.shape.rank != 0:
    raise ValueError(
        "expected model_fn to return a scalar loss, got shape %s%s in %s; did "
        "you forget tf.reduce_mean?" % (loss.shape.as_list(), of, tower))
  return loss


def check_var_list(var_list: object, keys: List[Key]) -> Dict[Key, object]:
  """Returns {key: var_list entry} before any tower is built.

  Raises:
    ValueError: for several losses without a var_list, or keys that differ
      from the optimizers'.
  """
  if keys == [SINGLE]:
    return {SINGLE: var_list}
  if var_list is None:
    if len(keys) == 1:
      return {keys[0]: None}
    raise ValueError(
        "several losses (%s) need var_list, a dict naming each loss's "
        "variables (var_list={'d': 'discriminator/', 'g': 'generator/'}): "
        "without it every loss's optimizer would train every variable, the "
        "generator in the discriminator's step" % ", ".join(map(repr, keys)))
  if not isinstance(var_list, Mapping):
    raise ValueError(
        "with several losses (%s), var_list must be a dict {key: variables} "
        "with the same keys (each a name prefix, a list of variables or a "
        "callable), got %r" % (", ".join(map(repr, keys)), var_list))
  for key in var_list:
    if key not in keys:
      raise ValueError("var_list names %r, which has no optimizer and no "
                       "loss; the keys are %s"
                       % (key, ", ".join(map(repr, keys))))
  missing = [k for k in keys if k not in var_list]
  if missing:
    raise ValueError(
        "var_list has no entry for %s: name the variables each loss trains "
        "(a name prefix such as 'generator/', a list of variables or a "
        "callable)" % ", ".join(map(repr, missing)))
  return {key: var_list[key] for key in keys}


def resolve(entries: Dict[Key, object]) -> Dict[Key, Optional[List[object]]]:
  """Returns each key's variables (None: every trainable one), resolving
  prefixes and callables now that tower 0 has made the variables.

  Raises:
    TypeError: for an entry that is not a prefix, a list or a callable.
    ValueError: for a prefix or callable that gives no variable, or one
      variable in two keys' lists.
  """
  candidates = _trainable()
  resolved: Dict[Key, Optional[List[object]]] = {}
  for key, entry in entries.items():
    resolved[key] = _resolve(key, entry, candidates)
  owners: Dict[int, Key] = {}
  for key, variables in resolved.items():
    for var in variables or ():
      other = owners.setdefault(id(var), key)
      if other != key:
        raise ValueError(
            "the variable %s is in both var_list[%r] and var_list[%r]: each "
            "variable is trained by one loss's optimizer, else each step "
            "would update it with its own; narrow the prefixes or lists"
            % (getattr(var, "name", var), other, key))
  return resolved


def _resolve(key: Key, entry: object,
             candidates: List[tf.Variable]) -> Optional[List[object]]:
  where = "var_list" if key is SINGLE else "var_list[%r]" % (key,)
  if entry is None:
    return None
  if isinstance(entry, str):
    found = [v for v in candidates if v.op.name.startswith(entry)]
    if not found:
      raise ValueError(
          "%s is the prefix %r, which no trainable variable's name starts "
          "with; the variables are %s" % (where, entry, ", ".join(
              v.op.name for v in candidates[:20]) or "none"))
    return found
  if callable(entry):
    found = entry()
    if not isinstance(found, (list, tuple)):
      raise TypeError("expected %s, a callable, to return a list of "
                      "variables, got %r" % (where, found))
    if not found:
      raise ValueError("%s, a callable, returned no variable once tower 0 "
                       "had made them" % where)
    return list(found)
  if hasattr(entry, "__iter__") and not isinstance(entry, tf.Variable):
    return list(entry)  # type: ignore[call-overload]
  raise TypeError(
      "expected %s to be a name prefix, a list of variables or a callable "
      "returning one, got %r" % (where, entry))


def _trainable() -> List[tf.Variable]:
  """What ``compute_gradients`` trains by default."""
  found = tf.trainable_variables() + tf.get_collection(
      tf.GraphKeys.TRAINABLE_RESOURCE_VARIABLES)
  return list({id(v): v for v in found}.values())


def keyed(value: Any, keys: List[Key]) -> Dict[Key, Any]:
  """`value` by key: a dict as it is, else the single loss's."""
  if keys == [SINGLE]:
    return {SINGLE: value}
  return dict(value)
