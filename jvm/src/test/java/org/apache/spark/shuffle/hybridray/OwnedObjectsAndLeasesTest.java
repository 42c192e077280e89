package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import io.ray.api.exception.RayActorException;
import io.ray.api.exception.RayTimeoutException;
import org.junit.jupiter.api.Test;

class OwnedObjectsAndLeasesTest {
  private final ObjectMapper json = new ObjectMapper();

  @Test
  void aShuffleDroppedHereKeepsNoObjectsALateTaskPutsForIt() {
    // A task of a cancelled job still running after its shuffle was unregistered here:
    // what it puts must not stay pinned until the executor exits (nobody reads it).
    OwnedObjects owned = new OwnedObjects();
    owned.own(1, 10L, null);
    owned.own(1, 12L, null);
    owned.own(2, 20L, null);
    assertEquals(2, owned.count(1));
    // The counts dropped decide whether a collection is asked for (collectDroppedObjects).
    assertEquals(2, owned.dropShuffle(1));
    assertEquals(0, owned.count(1));
    owned.own(1, 11L, null);
    assertEquals(0, owned.count(1));
    assertEquals(0, owned.dropShuffle(1));
    assertEquals(1, owned.count(2));  // other shuffles keep theirs
    assertEquals(0, owned.dropAttempt(2, 21L));
    assertEquals(1, owned.dropAttempt(2, 20L));
    assertEquals(0, owned.count(2));
    assertEquals(0, owned.dropAttempt(2, 20L));
  }

  @Test
  void aLateLeaseIsGivenBackWholeAsNothingWrittenAndARefusedOneNotAtAll() throws Exception {
    ObjectNode granted = (ObjectNode) json.readTree(
        "{\"lease\": {\"granted\": 4194304, \"target\": \"plasma\", \"books\": \"b1\"}}");
    // Named by the books that granted it: a tier manager started since ignores it.
    assertEquals("{\"shuffle\":\"spark-a-0\",\"settle\":[[\"memory\",4194304,\"plasma\",null,"
        + "\"b1\"]]}",
        json.writeValueAsString(HybridRayContext.lateLeaseSettlement(json, granted, "spark-a-0")));
    assertNull(HybridRayContext.lateLeaseSettlement(json, json.readTree("{\"lease\": null}"),
        "spark-a-0"));
  }

  @Test
  void aCallThatFoundItsActorDeadIsToldApartFromOtherFailures() {
    // Such a call drops the JVM's cached actor handles (a tier manager started again has
    // a new actor under the old name); a slow or failing call must keep them.
    assertTrue(HybridRayContext.isActorGone(new RayActorException()));
    assertTrue(HybridRayContext.isActorGone(
        new RuntimeException("wrapped", new RayActorException())));
    assertFalse(HybridRayContext.isActorGone(new RayTimeoutException("slow")));
    assertFalse(HybridRayContext.isActorGone(new IllegalStateException("bad answer")));
  }
}
