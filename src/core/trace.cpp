// src/core/trace.cpp - see trace.h.
#include "trace.h"

#include <cstdio>
#include <fstream>
#include <locale>

#include "../base/error.h"
#include "../base/text.h"

namespace fsdp::core {
namespace {

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

void Trace::begin() {
  std::lock_guard<std::mutex> lock(mu_);
  records_.clear();
  seq_ = 0;
  enabled_.store(true, std::memory_order_release);
  t0_ = std::chrono::steady_clock::now();
}

void Trace::add(const std::string& name, char phase, Track track, std::string args) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!enabled_.load(std::memory_order_relaxed)) return;
  double ts = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0_).count();
  records_.push_back({name, phase, track, ts, std::move(args), seq_++});
}

std::vector<Trace::Record> Trace::records() const {
  std::lock_guard<std::mutex> lock(mu_);
  return records_;
}

void Trace::write(const std::string& path, int rank) const {
  std::vector<Record> recs = records();
  std::ofstream out(path, std::ios::trunc);
  if (!out) fail(FSDP_ERR_IO, "fsdp_trace_write: cannot open " + base::quote(path) + " for writing");
  out.imbue(std::locale::classic());  // JSON numbers, whatever the host's C++ global locale
  out << "{\"traceEvents\": [\n";
  out << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " << rank << ", \"args\": {\"name\": \"rank " << rank
      << "\"}},\n";
  out << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << rank
      << ", \"tid\": 0, \"args\": {\"name\": \"calls\"}},\n";
  out << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << rank
      << ", \"tid\": 1, \"args\": {\"name\": \"comm stream\"}},\n";
  out << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << rank
      << ", \"tid\": 2, \"args\": {\"name\": \"copy streams (offload)\"}},\n";
  out << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << rank
      << ", \"tid\": 3, \"args\": {\"name\": \"gather stream\"}}";
  for (const Record& r : recs) {
    std::string ts = base::format_fixed(r.ts_us, 3);  // not printf: LC_NUMERIC may say ','
    out << ",\n{\"name\": \"" << escape(r.name) << "\", \"ph\": \"" << r.phase << "\", \"pid\": " << rank
        << ", \"tid\": " << static_cast<int>(r.track) << ", \"ts\": " << ts;
    if (r.phase == 'i') out << ", \"s\": \"t\"";
    out << ", \"args\": {\"seq\": " << r.seq << (r.args.empty() ? "" : ", ") << r.args << "}}";
  }
  out << "\n]}\n";
  out.flush();
  if (!out) fail(FSDP_ERR_IO, "fsdp_trace_write: writing " + base::quote(path) + " failed");
}

}  // namespace fsdp::core
