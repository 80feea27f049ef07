// tools/fsdp-ckpt/args.h - the command line of one fsdp-ckpt subcommand
// (options and positional arguments), the usage error, and the subcommands.
#pragma once

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp_ckpt {

// A mistake on the command line: exit status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Args {
  std::vector<std::string> pos;
  std::map<std::string, std::string> opts;  // "--json" -> "", "--world" -> "3"
  bool help = false;
  bool has(const std::string& opt) const { return opts.count(opt) != 0; }
};

// Splits `argv` (the words after the subcommand) into options and positional
// arguments. `flags` take no value; `valued` take one ("--world 3" or
// "--world=3"). "--" ends the options. -h / --help set `help`.
Args parse_args(const std::vector<std::string>& argv, const std::set<std::string>& flags,
                const std::set<std::string>& valued);

// "--world" as a shard count: an integer from 1 to kMaxWorld.
constexpr int kMaxWorld = 65536;
int parse_world(const std::string& opt, const std::string& value);

// The subcommands; each returns the process's exit status.
int run_inspect(const Args& a);
int run_verify(const Args& a);
int run_consolidate(const Args& a);
int run_reshard(const Args& a);

}  // namespace fsdp_ckpt
