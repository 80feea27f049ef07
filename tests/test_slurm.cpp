// Proves src/comm/slurm.{h,cpp}: Slurm's host lists and tasks-per-node
// strings expand as Slurm's own documentation writes them (the expected
// lists here are written out by hand from those rules), an srun task's
// SLURM_* variables give its rank, world and node share, a batch script
// (SLURM_PROCID but no step) is not taken for a rank of many, the
// rendezvous is the first host at a port every task of a step derives alike,
// and malformed values are refused naming the variable.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "base/error.h"
#include "comm/launch.h"
#include "comm/slurm.h"

using fsdp::comm::expand_slurm_hostlist;
using fsdp::comm::expand_slurm_tasks_per_node;

namespace {

using Strings = std::vector<std::string>;

// Sets `vars` for one test and restores the environment after it.
class Env {
 public:
  explicit Env(const std::map<std::string, std::string>& vars) {
    for (const char* n : kAll) unsetenv(n);
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
  }
  ~Env() {
    for (const char* n : kAll) unsetenv(n);
  }

 private:
  static constexpr const char* kAll[] = {
      "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID",
      "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_NODELIST",
      "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT",
      "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"};
};

TEST(SlurmHostlist, ExpandsRangesListsPaddingAndProducts) {
  EXPECT_EQ(expand_slurm_hostlist("node1", "L"), Strings({"node1"}));
  EXPECT_EQ(expand_slurm_hostlist("node[01-04,07]", "L"), Strings({"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(expand_slurm_hostlist("gpu[9-11],cpu5", "L"), Strings({"gpu9", "gpu10", "gpu11", "cpu5"}));
  EXPECT_EQ(expand_slurm_hostlist("a[008-010]", "L"), Strings({"a008", "a009", "a010"}));
  EXPECT_EQ(expand_slurm_hostlist("r[1-2]n[1-2]", "L"), Strings({"r1n1", "r1n2", "r2n1", "r2n2"}));
  EXPECT_EQ(expand_slurm_hostlist("x[3],y-[1-2].z", "L"), Strings({"x3", "y-1.z", "y-2.z"}));
}

TEST(SlurmHostlist, MalformedListsAreRefusedNamingTheVariable) {
  for (const char* bad : {"node[1-", "node1-3]", "node[a-b]", "node[5-2]", "a,,b", "", "n[1,]"}) {
    try {
      expand_slurm_hostlist(bad, "SLURM_STEP_NODELIST");
      ADD_FAILURE() << "accepted " << bad;
    } catch (const fsdp::Error& e) {
      EXPECT_EQ(e.status(), FSDP_ERR_INVALID_ARGUMENT) << bad;
      EXPECT_NE(std::string(e.what()).find("SLURM_STEP_NODELIST"), std::string::npos) << e.what();
    }
  }
}

TEST(SlurmTasksPerNode, ExpandsRepeats) {
  EXPECT_EQ(expand_slurm_tasks_per_node("4", "T"), std::vector<int>({4}));
  EXPECT_EQ(expand_slurm_tasks_per_node("2(x3),1", "T"), std::vector<int>({2, 2, 2, 1}));
  EXPECT_EQ(expand_slurm_tasks_per_node("8(x2)", "T"), std::vector<int>({8, 8}));
  for (const char* bad : {"2(3)", "2(x)", "x", "2(x3", ""}) {
    EXPECT_THROW(expand_slurm_tasks_per_node(bad, "T"), fsdp::Error) << bad;
  }
}

TEST(SlurmEnv, AnSrunTaskKnowsItsRankWorldAndNodeShare) {
  Env env({{"SLURM_STEP_ID", "0"},
           {"SLURM_PROCID", "5"},
           {"SLURM_STEP_NUM_TASKS", "7"},
           {"SLURM_NTASKS", "16"},  // the allocation's, not the step's
           {"SLURM_LOCALID", "1"},
           {"SLURM_NODEID", "2"},
           {"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"}});
  fsdp::comm::LaunchEnv e = fsdp::comm::read_launch_env();
  EXPECT_EQ(e.source, "SLURM_*");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world, 7);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world, 2);
}

TEST(SlurmEnv, ABatchScriptIsNotARankOfMany) {
  // sbatch runs the script with SLURM_PROCID=0 and the allocation's task
  // count, but no step: a program started there without srun is one process.
  Env env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "16"}, {"SLURM_JOB_ID", "42"}});
  EXPECT_FALSE(fsdp::comm::read_launch_env().present());
  std::string host;
  int port = 0;
  EXPECT_FALSE(fsdp::comm::slurm_rendezvous(&host, &port));
}

TEST(SlurmEnv, MpirunsVariablesComeFirst) {
  Env env({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"SLURM_STEP_ID", "0"},
           {"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "1"}});
  EXPECT_EQ(fsdp::comm::read_launch_env().source, "OMPI_COMM_WORLD_*");
}

TEST(SlurmEnv, BadValuesAreRefusedNamingTheVariable) {
  Env env({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "4"}, {"SLURM_STEP_NUM_TASKS", "4"}});
  try {
    fsdp::comm::read_launch_env();
    ADD_FAILURE() << "a rank past the world was accepted";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("SLURM_PROCID=4"), std::string::npos) << e.what();
  }
}

TEST(SlurmRendezvous, FirstHostAndAPortFromTheJobAndStep) {
  {
    Env env({{"SLURM_STEP_ID", "3"}, {"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "16"},
             {"SLURM_STEP_NODELIST", "gpu[07-08]"}, {"SLURM_JOB_NODELIST", "gpu[01-08]"}, {"SLURM_JOB_ID", "123456"}});
    std::string host;
    int port = 0;
    ASSERT_TRUE(fsdp::comm::slurm_rendezvous(&host, &port));
    EXPECT_EQ(host, "gpu07");
    EXPECT_EQ(port, 20000 + (123456 * 16 + 3) % 40000);
  }
  {
    Env env({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "1"}, {"SLURM_STEP_NUM_TASKS", "2"},
             {"SLURM_JOB_NODELIST", "n1"}, {"SLURM_JOB_ID", "9"}, {"MASTER_PORT", "29500"},
             {"MASTER_ADDR", "10.0.0.1"}});
    std::string host;
    int port = 0;
    ASSERT_TRUE(fsdp::comm::slurm_rendezvous(&host, &port));
    EXPECT_EQ(host, "10.0.0.1");
    EXPECT_EQ(port, 29500);
  }
}

}  // namespace
