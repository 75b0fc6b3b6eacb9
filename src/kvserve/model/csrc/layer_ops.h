// Fused per-layer elementwise ops (layer_ops.cpp), bound into the same extension module.
#pragma once

#include <torch/extension.h>

void register_layer_ops(pybind11::module& m);
