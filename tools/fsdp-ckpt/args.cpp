// tools/fsdp-ckpt/args.cpp - command-line parsing for fsdp-ckpt (see args.h).
#include "args.h"

#include <cerrno>
#include <cstdlib>

namespace fsdp_ckpt {

Args parse_args(const std::vector<std::string>& argv, const std::set<std::string>& flags,
                const std::set<std::string>& valued) {
  Args a;
  bool options_done = false;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& w = argv[i];
    if (options_done || w.size() < 2 || w[0] != '-') {
      a.pos.push_back(w);
      continue;
    }
    if (w == "--") {
      options_done = true;
      continue;
    }
    if (w == "-h" || w == "--help") {
      a.help = true;
      continue;
    }
    std::string name = w;
    std::string value;
    bool inline_value = false;
    size_t eq = w.find('=');
    if (w.rfind("--", 0) == 0 && eq != std::string::npos) {
      name = w.substr(0, eq);
      value = w.substr(eq + 1);
      inline_value = true;
    }
    if (flags.count(name) != 0) {
      if (inline_value) throw UsageError("option " + name + " takes no value");
      a.opts[name] = "";
    } else if (valued.count(name) != 0) {
      if (!inline_value) {
        if (i + 1 >= argv.size()) throw UsageError("option " + name + " needs a value");
        value = argv[++i];
      }
      a.opts[name] = value;
    } else {
      throw UsageError("unknown option '" + w + "'");
    }
  }
  return a;
}

int parse_world(const std::string& opt, const std::string& value) {
  const std::string what = opt + " must be an integer from 1 to " + std::to_string(kMaxWorld) + ", not '" + value + "'";
  if (value.empty() || value.find_first_not_of("0123456789") != std::string::npos) throw UsageError(what);
  errno = 0;
  char* end = nullptr;
  unsigned long long n = std::strtoull(value.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || n < 1 || n > static_cast<unsigned long long>(kMaxWorld)) throw UsageError(what);
  return static_cast<int>(n);
}

}  // namespace fsdp_ckpt
