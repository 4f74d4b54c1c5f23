// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// Shared by both extension modules (fastcomms._C and fastcomms._c10d): Python only, nothing of
// the fastcomms library or of either module's pybind11.
#include <Python.h>

namespace fastcomms::python {

/// Whether this thread may take the GIL: not once the interpreter is finalizing (Python ends a
/// thread other than the finalizing one that asks for it, and the unwind through a destructor
/// terminates the process). A reference dropped then is left to the exiting process.
inline bool usable() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

}  // namespace fastcomms::python
