// Float32 projections over weights packed in panels (panel_linear.cpp), bound into the same
// extension module.
#pragma once

#include <torch/extension.h>

void register_panel_linear(pybind11::module& m);
