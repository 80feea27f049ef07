// src/comm/slurm.h - what Slurm's srun tells the processes it starts: rank,
// world and this node's share from its SLURM_* variables, and where a
// rendezvous that needs a host and a port (the NCCL id's TCP exchange) goes:
// the first host of the step's node list, expanded as Slurm writes ranges
// ("node[01-04,07]"), at a port derived from the job and step ids unless
// MASTER_PORT gives one. The parsers are here, tested, not a shell-out to
// `scontrol show hostnames`.
#pragma once

#include <string>
#include <vector>

namespace fsdp::comm {

struct LaunchEnv;  // launch.h

// "node[01-04,07],gpu5" -> node01 node02 node03 node04 node07 gpu5. Several
// bracket groups in one name expand as a product ("r[1-2]n[1-2]" -> r1n1
// r1n2 r2n1 r2n2); a range keeps its lower bound's zero padding. Throws
// FSDP_ERR_INVALID_ARGUMENT naming `what` and the text when malformed.
std::vector<std::string> expand_slurm_hostlist(const std::string& text, const std::string& what);

// SLURM_STEP_TASKS_PER_NODE's form: "2(x3),1" -> 2 2 2 1. Throws as above.
std::vector<int> expand_slurm_tasks_per_node(const std::string& text, const std::string& what);

// The launch env of an srun task (SLURM_STEP_ID set: the processes of a job
// step; a batch script alone, which Slurm gives SLURM_PROCID=0 too, is not
// one): rank SLURM_PROCID of SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), local
// rank SLURM_LOCALID of the tasks SLURM_STEP_TASKS_PER_NODE puts on node
// SLURM_NODEID. Not present (source empty) outside srun.
LaunchEnv read_slurm_env();

// The rendezvous of an srun step: the first host of SLURM_STEP_NODELIST (else
// SLURM_JOB_NODELIST, SLURM_NODELIST) and MASTER_PORT if set, else 20000 +
// (SLURM_JOB_ID * 16 + SLURM_STEP_ID) mod 40000, the same on every task of
// the step and apart for the steps of one job. False outside srun.
bool slurm_rendezvous(std::string* host, int* port);

}  // namespace fsdp::comm
