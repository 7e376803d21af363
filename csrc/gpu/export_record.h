// What a rank of the GPU transport publishes about its heap
// (GpuComm::export_handle): both IPC handles and its GPU's PCI bus id (a
// peer maps it to its own device ordinal).
#pragma once

#include "runtime.h"

namespace rdna4_comm {
namespace gpu {

struct ExportRecord {
  IpcHandle signals;
  IpcHandle data;
  char pci_bus_id[32];
};

}  // namespace gpu
}  // namespace rdna4_comm
