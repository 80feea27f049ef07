// src/ckpt/snapshot.cpp - the snapshot marker: a small JSON file replaced by
// a rename, so that it is always one whole marker (see snapshot.h).
#include "snapshot.h"

#include <cstdio>
#include <nlohmann/json.hpp>

#include "../base/error.h"
#include "../base/text.h"
#include "io.h"

namespace fsdp::ckpt {
namespace {

constexpr const char* kMarkerFile = "snapshot.json";
constexpr const char* kFormat = "libfsdp-snapshot";
constexpr int kVersion = 2;

std::string read_text(const std::string& path) {
  File f = File::open_read(path);
  std::string text(f.size(), '\0');
  f.pread_exact(0, text.data(), text.size());
  return text;
}

}  // namespace

std::string snapshot_rank_dir(const std::string& path, int rank) { return join(path, "rank" + std::to_string(rank)); }

std::string snapshot_slot_dir(const std::string& path, int rank, int slot) {
  return join(snapshot_rank_dir(path, rank), "slot" + std::to_string(slot));
}

bool read_snapshot_marker(const std::string& path, int rank, SnapshotMarker* out, std::string* why) {
  const std::string file = join(snapshot_rank_dir(path, rank), kMarkerFile);
  if (!path_exists(file)) {
    *why = "no snapshot at " + base::quote_path(file);
    return false;
  }
  try {
    nlohmann::json j = nlohmann::json::parse(read_text(file));
    if (j.value("format", "") != kFormat || j.value("version", 0) != kVersion) {
      *why = base::quote_path(file) + " is not a libfsdp snapshot marker of version " + std::to_string(kVersion);
      return false;
    }
    SnapshotMarker m;
    m.rank = j.at("rank").get<int>();
    m.world = j.at("world").get<int>();
    for (const auto& s : j.at("slots")) {
      SnapshotSlot slot{s.at("slot").get<int>(), s.at("step").get<int64_t>(), s.at("run").get<std::string>()};
      if ((slot.slot != 0 && slot.slot != 1) || slot.step < 0 || slot.run.empty() ||
          slot.run.find_first_of(" :") != std::string::npos) {
        *why = base::quote_path(file) + " names a slot out of range";
        return false;
      }
      m.slots.push_back(slot);
    }
    *out = std::move(m);
    return true;
  } catch (const nlohmann::json::exception& e) {
    *why = base::quote_path(file) + " is damaged (" + e.what() + ")";
  } catch (const Error& e) {
    *why = e.what();
  }
  return false;
}

void write_snapshot_marker(const std::string& path, const SnapshotMarker& m) {
  nlohmann::json j;
  j["format"] = kFormat;
  j["version"] = kVersion;
  j["rank"] = m.rank;
  j["world"] = m.world;
  j["slots"] = nlohmann::json::array();
  for (const SnapshotSlot& s : m.slots) j["slots"].push_back({{"slot", s.slot}, {"step", s.step}, {"run", s.run}});
  const std::string text = j.dump() + "\n";
  const std::string dir = snapshot_rank_dir(path, m.rank);
  const std::string file = join(dir, kMarkerFile), tmp = file + ".new";
  remove_tree(tmp);  // one left by a process that died writing it
  File f = File::create(tmp);
  f.write_all(text.data(), text.size());
  f.sync();
  f.close();
  if (std::rename(tmp.c_str(), file.c_str()) != 0) {
    fail(FSDP_ERR_IO, "cannot rename " + base::quote_path(tmp) + " to " + base::quote_path(file));
  }
  sync_dir(dir);
}

}  // namespace fsdp::ckpt
