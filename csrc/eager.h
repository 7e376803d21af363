// The ops' eager entry points (eager.cpp).
#pragma once

#include <torch/python.h>

namespace rdna4_comm {
namespace eager {

// rdna4_comm._C.eager.<op> for every op of the table, and is_plain_call.
void def_all(py::module_& m);

}  // namespace eager
}  // namespace rdna4_comm
