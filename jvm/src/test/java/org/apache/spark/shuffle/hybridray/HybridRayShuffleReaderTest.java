package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertSame;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.fasterxml.jackson.databind.ObjectMapper;
import io.ray.api.exception.RayActorException;
import io.ray.api.exception.RayTaskException;
import io.ray.api.exception.RayTimeoutException;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.ObjectOutputStream;
import java.util.Base64;
import java.util.HashMap;
import org.apache.spark.shuffle.FetchFailedException;
import org.apache.spark.storage.BlockManagerId;
import org.junit.jupiter.api.Test;

class HybridRayShuffleReaderTest {
  @Test
  void theBlockTheMasterSaysIsLostIsBlamedNotTheFirstMissingOne() throws Exception {
    // Map 0's last commit is still on its way, map 1's attempt was aborted: the reader
    // blamed the first missing block (map 0's), so Spark dropped a healthy executor's
    // outputs and the next stage attempt failed again on map 1.
    ObjectMapper json = new ObjectMapper();
    assertEquals(1, HybridRayShuffleReader.lostIndex(json.readTree(
        "{\"blocks\": [null, null], \"awaited\": false, \"lost\": [1]}"), 2));
    assertEquals(2, HybridRayShuffleReader.lostIndex(json.readTree(
        "{\"blocks\": [null, null, null], \"awaited\": false, \"lost\": [2, 0]}"), 3));
    // None lost: all may still come (the reader waits, within commitWaitMs).
    assertEquals(-1, HybridRayShuffleReader.lostIndex(json.readTree(
        "{\"blocks\": [null], \"awaited\": true, \"lost\": []}"), 1));
    assertEquals(-1, HybridRayShuffleReader.lostIndex(json.readTree(
        "{\"blocks\": [null], \"awaited\": false}"), 1));
    // An index the reader did not ask for names no block.
    assertEquals(-1, HybridRayShuffleReader.lostIndex(json.readTree(
        "{\"blocks\": [null], \"awaited\": false, \"lost\": [5, -1, \"0\"]}"), 1));
  }

  @Test
  void anObjectWhoseBatchTimedOutIsNotWaitedForTheWholeTimeoutAgain() {
    // A prefetch batch that timed out fell back to per-segment fetches that each waited
    // fetchTimeoutMs again: a stuck object held the task twice the configured bound.
    assertEquals(600_000, HybridRayShuffleReader.fetchTimeoutMs(600_000, false));
    assertEquals(HybridRayShuffleReader.AFTER_BATCH_TIMEOUT_MS,
        HybridRayShuffleReader.fetchTimeoutMs(600_000, true));
    // A bound shorter than the grace stays the bound.
    assertEquals(200, HybridRayShuffleReader.fetchTimeoutMs(200, true));
  }

  @Test
  void aMasterThatDidNotAnswerBlamesNoExecutor() {
    // A locate call that timed out or found the master dead fails the reduce task; only
    // the master's own answer (an unknown shuffle, say) becomes a FetchFailedException,
    // which makes Spark drop the blamed executor's map outputs.
    assertTrue(HybridRayShuffleReader.isControlPlaneFault(
        new IOException("hybrid_ray call spark_locate failed", new RayTimeoutException("2 min"))));
    assertTrue(HybridRayShuffleReader.isControlPlaneFault(
        new IOException("hybrid_ray call spark_locate failed", new RayActorException())));
    assertFalse(HybridRayShuffleReader.isControlPlaneFault(new IOException(
        "hybrid_ray call spark_locate failed", new RayTaskException("ShuffleNotFoundError"))));
    assertFalse(HybridRayShuffleReader.isControlPlaneFault(new IOException("bad JSON")));
    // A master that is not running at all (its lookup found no actor) blames no executor
    // either: Spark recomputed the first block's executor's outputs for nothing.
    assertTrue(HybridRayShuffleReader.isControlPlaneFault(
        new HybridRayContext.MasterNotRunningException("no actor 'hybrid_ray_master'")));
  }

  @Test
  void aMemoryLocationThatIsNoObjectRefIsRefusedBeforeAnythingElseIsBuilt() throws Exception {
    // Locations come from the master's books; Java deserialization of any other class
    // (here a HashMap: a gadget chain would start the same way) must be refused.
    ByteArrayOutputStream bytes = new ByteArrayOutputStream();
    try (ObjectOutputStream out = new ObjectOutputStream(bytes)) {
      out.writeObject(new HashMap<String, String>());
    }
    String location = Base64.getEncoder().encodeToString(bytes.toByteArray());
    IOException refused = assertThrows(IOException.class,
        () -> HybridRayShuffleReader.decodeRef(location));
    assertTrue(refused.getMessage().contains("REJECTED"), refused.getMessage());
    assertThrows(IOException.class, () -> HybridRayShuffleReader.decodeRef("not base64!"));
  }

  @Test
  void onlyALostSegmentBlamesTheWritersExecutorAtFirst() {
    // A store or actor that did not answer says nothing about the map output: the task's
    // first attempt fails and Spark runs it again. Before, every failure became a
    // FetchFailedException, so a throttled store or a restarted tier manager made Spark
    // recompute every output of the writer's executor. A retry that cannot read it either
    // (a node that stays hung) recomputes the map, rather than failing the job after
    // spark.task.maxFailures tries of the same read.
    BlockManagerId writer = null;  // BlockManagerId.apply needs Spark's shaded Guava
    HybridRayShuffleReader.SegmentUnavailableException throttled =
        new HybridRayShuffleReader.SegmentUnavailableException("remote tier throttled",
            new IOException("SlowDown"));
    Throwable firstTry = HybridRayShuffleReader.readFailure(throttled, 0, writer, 3, 11L, 2, 5);
    assertFalse(firstTry instanceof FetchFailedException);
    assertTrue(firstTry instanceof IOException);
    assertTrue(firstTry.getMessage().contains("remote tier throttled"));
    assertTrue(HybridRayShuffleReader.readFailure(throttled, 1, writer, 3, 11L, 2, 5)
        instanceof FetchFailedException);
    Throwable gone = HybridRayShuffleReader.readFailure(
        new IOException("segment 0 is gone from the remote tier"), 0, writer, 3, 11L, 2, 5);
    assertTrue(gone instanceof FetchFailedException);
    assertTrue(gone.getMessage().contains("gone from the remote tier"), gone.getMessage());
    LocalSegmentFiles.UnsafeSegmentPathException unsafe =
        new LocalSegmentFiles.UnsafeSegmentPathException("outside the spill dirs");
    assertSame(unsafe, HybridRayShuffleReader.readFailure(unsafe, 1, writer, 3, 11L, 2, 5));
  }
}
