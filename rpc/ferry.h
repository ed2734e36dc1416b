// File: rpc/ferry.h
//
// The umbrella header: everything a ferry program uses.
//
//   #include "rpc/ferry.h"
#pragma once

#include "backends/backend_registry.h"
#include "backends/process_group/process_group_backend.h"
#include "backends/tensorpipe/tensorpipe_backend.h"
#include "base/future.h"
#include "base/status.h"
#include "rpc/call.h"
#include "rpc/function_registry.h"
#include "rpc/remote_function.h"
#include "rpc/rpc.h"
#include "rpc/rref.h"
#include "tensor/tensor.h"
