// The batch-invariant projection (invariant_linear.cpp), bound into the same extension module.
#pragma once

#include <torch/extension.h>

void register_invariant_linear(pybind11::module& m);
