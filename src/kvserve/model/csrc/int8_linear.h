// Int8 (W8A8) projections over weights packed in pairs-of-k panels (int8_linear.cpp), bound
// into the same extension module.
#pragma once

#include <torch/extension.h>

void register_int8_linear(pybind11::module& m);
