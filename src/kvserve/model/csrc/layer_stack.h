// A step's decoder layers in one call (layer_stack.cpp), bound into the same
// extension module.
#pragma once

#include <torch/extension.h>

void register_layer_stack(pybind11::module& m);
