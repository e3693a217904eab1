"""kiln-kernels: MatMulNBits -> ai.kiln MatMulNBits where the kernel can take the node; refusals leave it as it was."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.passes.kiln_kernels import DOMAIN, UseKilnKernels, fallback, fallback_name


def model(accuracy_level=4, bits=4, block=32, b_initializer=True, scales_cast=False, bias=False):
    k, n = 64, 16
    inits = [numpy_helper.from_array(np.ones((n, k // block, block * bits // 8), np.uint8), "B")] if b_initializer else []
    nodes, inputs = [], [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, k])]
    if not b_initializer:
        inputs.append(helper.make_tensor_value_info("B", TensorProto.UINT8, [n, k // block, block * bits // 8]))
    if scales_cast:
        inits.append(numpy_helper.from_array(np.ones((n, k // block), np.float16), "S16"))
        nodes.append(helper.make_node("Cast", ["S16"], ["S"], to=TensorProto.FLOAT))
    else:
        inits.append(numpy_helper.from_array(np.ones((n, k // block), np.float32), "S"))
    names = ["A", "B", "S"]
    if bias:
        inits.append(numpy_helper.from_array(np.zeros(n, np.float32), "bias"))
        names += ["", "", "bias"]
    nodes.append(helper.make_node("MatMulNBits", names, ["Y"], name="mm", domain="com.microsoft", K=k, N=n, bits=bits,
                                  block_size=block, accuracy_level=accuracy_level))
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("kw", [{}, {"bits": 8}, {"scales_cast": True}, {"block": 16}])
def test_fires(kw):
    result = UseKilnKernels().run(model(**kw))
    node = next(n for n in result.model.graph.node if n.op_type == "MatMulNBits")
    assert result.modified and result.stats["kiln_kernels"] == 1 and node.domain == DOMAIN
    assert any(o.domain == DOMAIN for o in result.model.opset_import)


@pytest.mark.parametrize("kw, why", [({"accuracy_level": 0}, "accuracy_level 0"),
                                     ({"b_initializer": False}, "not an initializer"),
                                     ({"bias": True}, "g_idx or bias")])
def test_must_not_fire(kw, why):
    m = model(**kw)
    before = m.SerializeToString()
    result = UseKilnKernels().run(m)
    assert not result.modified and result.stats["kiln_kernels"] == 0
    assert why in result.skipped[0].why
    assert result.model.SerializeToString() == before  # a refused node leaves the graph exactly as it was


def test_twice_changes_nothing_and_fallback_undoes_it():
    once = UseKilnKernels().run(model()).model
    again = UseKilnKernels().run(onnx.ModelProto.FromString(once.SerializeToString()))
    assert not again.modified
    back = onnx.ModelProto.FromString(once.SerializeToString())
    assert fallback(back) == 1
    assert back.graph.SerializeToString() == model().graph.SerializeToString()
    assert not any(o.domain == DOMAIN for o in back.opset_import)
    assert fallback_name("model.onnx") == "model.fallback.onnx"
