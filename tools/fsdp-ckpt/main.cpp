// tools/fsdp-ckpt/main.cpp - fsdp-ckpt's entry point: usage texts, dispatch to
// the subcommands, and the mapping of errors to exit statuses.
#include <cstdio>
#include <new>
#include <string>
#include <vector>

#include "args.h"
#include "base/error.h"

namespace fsdp_ckpt {
namespace {

constexpr const char* kUsage =
    "usage: fsdp-ckpt <command> [options] ...\n"
    "\n"
    "Inspects, checks and converts libfsdp checkpoints (directories written by fsdp_save).\n"
    "\n"
    "commands:\n"
    "  inspect DIR [--json]          what a checkpoint holds: kind, job, optimizer, units, params, files\n"
    "  verify DIR                    reads every file whole and checks every checksum\n"
    "  consolidate SRC DST           any checkpoint -> a full one (model.safetensors + optimizer.safetensors)\n"
    "  reshard --world N SRC DST     any checkpoint -> a sharded one of N shard files\n"
    "\n"
    "'fsdp-ckpt <command> --help' describes a command.\n"
    "\n"
    "exit status: 0 success; 1 the checkpoint is corrupt or fails verification;\n"
    "             2 usage error; 3 I/O or other error.\n";

constexpr const char* kInspectUsage =
    "usage: fsdp-ckpt inspect DIR [--json]\n"
    "\n"
    "Prints what the checkpoint in DIR holds, from its metadata (fsdp_checkpoint.json): its kind\n"
    "(sharded or full), format version, the library and job that wrote it (world size, sharding,\n"
    "shard world), the optimizer (kind, hyper-parameters, step, state tensors), the loss scale,\n"
    "each unit with its params (name, shape, dtype, numel) and each file with its size. The data\n"
    "files are not read: 'fsdp-ckpt verify' checks them.\n"
    "\n"
    "  --json   print one JSON object instead (keys: kind, format, format_version, library,\n"
    "           world_size, sharding, shard_world, align_elems, chunk_bytes, step, optimizer,\n"
    "           loss_scaler, units[].params[], files[], total_bytes)\n";

constexpr const char* kVerifyUsage =
    "usage: fsdp-ckpt verify DIR\n"
    "\n"
    "Checks the checkpoint in DIR: its metadata, then every file it lists: present, of the\n"
    "recorded size, its header matching its checksum and the layout, and every tensor read\n"
    "whole against its per-chunk and whole-tensor CRC-32s. Prints OK, or each problem found\n"
    "(naming the file and tensor) and exits 1.\n";

constexpr const char* kConsolidateUsage =
    "usage: fsdp-ckpt consolidate SRC DST\n"
    "\n"
    "Writes the checkpoint in SRC (sharded or full, any world size) as a full checkpoint in DST:\n"
    "model.safetensors with each param under its name and shape, optimizer.safetensors with\n"
    "'<param>.<state>' tensors (when the optimizer keeps state), and fsdp_checkpoint.json.\n"
    "fsdp_load reads it at any world size; any safetensors reader reads the model file.\n"
    "Streams one param at a time through a buffer of at most 16 MiB. Param names must be\n"
    "unique. DST is assembled in a hidden sibling directory and renamed into place, replacing\n"
    "an older checkpoint there atomically; DST may not be SRC, contain it, or be a non-empty\n"
    "directory that is not a checkpoint. Every chunk read is checked against its checksum.\n";

constexpr const char* kReshardUsage =
    "usage: fsdp-ckpt reshard --world N SRC DST\n"
    "\n"
    "Writes the checkpoint in SRC (sharded or full, any world size) as a sharded checkpoint of N\n"
    "shard files in DST, laid out as an N-rank FULL_SHARD job lays out its units (with SRC's\n"
    "alignment), so that N ranks each read exactly one file. fsdp_load reads it at any world\n"
    "size. Writes one unit's shard at a time (memory stays near the largest unit's shard).\n"
    "Replaces DST crash-safely, with the same rules as consolidate.\n"
    "\n"
    "  --world N   the number of shards (1 to 65536)\n";

struct Command {
  const char* name;
  const char* usage;
  std::set<std::string> flags;
  std::set<std::string> valued;
  size_t n_pos;
  int (*run)(const Args&);
};

const std::vector<Command>& commands() {
  static const std::vector<Command> cmds = {
      {"inspect", kInspectUsage, {"--json"}, {}, 1, run_inspect},
      {"verify", kVerifyUsage, {}, {}, 1, run_verify},
      {"consolidate", kConsolidateUsage, {}, {}, 2, run_consolidate},
      {"reshard", kReshardUsage, {}, {"--world"}, 2, run_reshard},
  };
  return cmds;
}

void error(const std::string& msg) { std::fprintf(stderr, "fsdp-ckpt: %s\n", msg.c_str()); }

int run(const std::vector<std::string>& argv) {
  if (argv.empty()) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const std::string& name = argv[0];
  if (name == "-h" || name == "--help" || name == "help") {
    if (name == "help" && argv.size() > 1) {
      for (const Command& c : commands()) {
        if (argv[1] == c.name) {
          std::fputs(c.usage, stdout);
          return 0;
        }
      }
      error("unknown command '" + argv[1] + "'");
      return 2;
    }
    std::fputs(kUsage, stdout);
    return 0;
  }
  const Command* cmd = nullptr;
  for (const Command& c : commands()) {
    if (name == c.name) cmd = &c;
  }
  if (cmd == nullptr) {
    error("unknown command '" + name + "' (commands: inspect, verify, consolidate, reshard; see fsdp-ckpt --help)");
    return 2;
  }
  try {
    Args a = parse_args(std::vector<std::string>(argv.begin() + 1, argv.end()), cmd->flags, cmd->valued);
    if (a.help) {
      std::fputs(cmd->usage, stdout);
      return 0;
    }
    if (a.pos.size() != cmd->n_pos) {
      throw UsageError(std::string(cmd->name) + " takes " + std::to_string(cmd->n_pos) + " argument" +
                       (cmd->n_pos == 1 ? "" : "s") + ", got " + std::to_string(a.pos.size()));
    }
    for (const std::string& p : a.pos) {
      if (p.empty()) throw UsageError("an empty path was given");
    }
    return cmd->run(a);
  } catch (const UsageError& e) {
    error(e.what());
    std::fprintf(stderr, "Try 'fsdp-ckpt %s --help'.\n", cmd->name);
    return 2;
  } catch (const fsdp::Error& e) {
    error(e.what());
    return e.status() == FSDP_ERR_CORRUPT ? 1 : 3;
  } catch (const std::bad_alloc&) {
    error("out of memory");
    return 3;
  } catch (const std::exception& e) {
    error(e.what());
    return 3;
  }
}

}  // namespace
}  // namespace fsdp_ckpt

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  return fsdp_ckpt::run(args);
}
