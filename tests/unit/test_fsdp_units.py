"""How a model is cut into FSDP2 units, and the in-place backend's template of it: tied
parameters (an embedding tied to the output layer) must end up in one unit, or FSDP2 refuses
the model, and the template must keep them tied without copying any value."""

from __future__ import annotations

from torch import nn

from hvd_resilient.backends.inplace.fsdp import _meta_copy
from hvd_resilient.backends.torchdist.fsdp import _tied_together, _units
from tests.support.recipes import RecipeModel


def test_units_that_share_a_parameter_are_sharded_together():
    model = RecipeModel()  # embed.weight is out.weight
    groups = _tied_together(_units(model))
    names = {id(m): n for n, m in model.named_modules()}
    as_names = sorted(sorted(names[id(m)] for m in g) for g in groups)
    assert as_names == [["embed", "out"], ["frozen"], ["hidden"], ["norm"]]


def test_units_without_ties_stay_one_each_in_order():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    assert _tied_together(_units(model)) == [[model[0]], [model[2]]]


def test_the_template_is_on_meta_keeps_ties_and_leaves_the_model_alone():
    model = RecipeModel()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    meta = _meta_copy(model)
    assert all(t.is_meta for t in [*meta.parameters(), *meta.buffers()])
    assert meta.out.weight is meta.embed.weight
    assert not meta.frozen.weight.requires_grad and meta.hidden.weight.requires_grad
    assert type(meta) is RecipeModel
    after = model.state_dict()
    assert all(not t.is_meta and t.equal(before[n]) for n, t in after.items())
