// A decode step's decoder layers in one call (decode_stack.cpp), bound into the same
// extension module.
#pragma once

#include <torch/extension.h>

void register_decode_stack(pybind11::module& m);
